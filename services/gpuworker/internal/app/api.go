package app

import (
	"net/http"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/deadletter/dlqhttp"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
)

// PoolAnswer is the body of GET /v1/pool.
type PoolAnswer = adminapi.PoolAnswer

// DevicesPage is the body of GET /v1/devices: the GPU inventory with one
// page of its devices, in index order.
type DevicesPage struct {
	devices.Inventory
	// NextCursor fetches the next page; absent on the last one.
	NextCursor string `json:"next_cursor,omitempty"`
}

// deviceCursor is the position after the last device of a page.
type deviceCursor struct {
	// Index is the NVML index of the page's last device.
	Index *int `json:"i"`
}

// mountAPI adds the inventory, pool and dead-letter routes and the OpenAPI
// document.
func (a *App) mountAPI() {
	a.srv.ServeOpenAPI(OpenAPI)
	r := a.srv.Router()
	dlqhttp.New(a.deadLetters, a.replay, a.deps.Log).Mount(r, a.srv.RequireAdmin(), a.srv.RequireAdmin())
	r.Get("/v1/devices", a.getDevices)
	r.Get("/v1/pool", a.getPool)
	r.With(a.srv.RequireAdmin()).Post("/v1/pool/reset", func(w http.ResponseWriter, r *http.Request) {
		a.pool.Reset()
		a.getPool(w, r)
	})
}

// getDevices answers one page of the GPU inventory (limit, cursor).
func (a *App) getDevices(w http.ResponseWriter, r *http.Request) {
	limit, ok := httpserver.PageLimit(w, r)
	if !ok {
		return
	}
	var c deviceCursor
	present, ok := httpserver.PageCursor(w, r, &c)
	if !ok {
		return
	}
	if present && c.Index == nil {
		httpserver.BadParameter(w, r, httpserver.ParamCursor, "cursor names no device")
		return
	}
	inv := a.gpus.Inventory()
	page := DevicesPage{Inventory: inv}
	page.Devices = make([]devices.Device, 0, min(limit, len(inv.Devices)))
	for _, d := range inv.Devices {
		if present && d.Index <= *c.Index {
			continue
		}
		if len(page.Devices) == limit {
			last := page.Devices[limit-1].Index
			page.NextCursor = httpserver.EncodeCursor(deviceCursor{Index: &last})
			break
		}
		page.Devices = append(page.Devices, d)
	}
	_ = httpserver.WriteJSON(w, http.StatusOK, page) // a failed write means the client left
}

// getPool answers the pool's groups and occupancy.
func (a *App) getPool(w http.ResponseWriter, _ *http.Request) {
	ans := PoolAnswer{
		EngineID: a.cfg.EngineID, Model: a.model.Name, Fingerprint: a.model.Fingerprint(),
		DataplaneURL: a.worker.Addr, Groups: a.pool.Stats(a.model),
	}
	ans.Rank = a.cfg.Rank()
	_ = httpserver.WriteJSON(w, http.StatusOK, ans) // a failed write means the client left
}
