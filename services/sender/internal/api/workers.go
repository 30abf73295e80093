package api

import (
	"fmt"
	"net/http"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

// WorkerPage is one page of GET /v1/workers.
type WorkerPage = adminapi.WorkerPage

func (a *API) listWorkers(w http.ResponseWriter, r *http.Request) {
	f := registry.Filter{EngineID: r.URL.Query().Get("engine_id"), State: r.URL.Query().Get("state")}
	if f.State != "" && f.State != adminapi.WorkerAlive && f.State != adminapi.WorkerStale {
		httpserver.BadParameter(w, r, "state", fmt.Sprintf("state %q is not %s or %s", f.State, adminapi.WorkerAlive, adminapi.WorkerStale))
		return
	}
	var ok bool
	if f.Limit, ok = httpserver.PageLimit(w, r); !ok {
		return
	}
	var c registry.Cursor
	present, ok := httpserver.PageCursor(w, r, &c)
	if !ok {
		return
	}
	if present {
		if c.EngineID == "" {
			httpserver.BadParameter(w, r, httpserver.ParamCursor, "cursor names no worker")
			return
		}
		f.After = &c
	}
	want := f.Limit
	f.Limit++ // one more tells whether a next page exists
	rows, err := a.workers.List(r.Context(), f)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	page := WorkerPage{Items: rows, StaleAfterSeconds: a.workers.StaleAfter().Seconds()}
	if len(rows) > want {
		page.Items = rows[:want]
		page.NextCursor = httpserver.EncodeCursor(registry.CursorOf(rows[want-1]))
	}
	a.write(w, http.StatusOK, page)
}
