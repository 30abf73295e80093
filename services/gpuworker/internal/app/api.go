package app

import (
	"net/http"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// PoolAnswer is the body of GET /v1/pool.
type PoolAnswer struct {
	// EngineID and Rank name the pool.
	EngineID string `json:"engine_id"`
	Rank     struct {
		TP  int `json:"tp"`
		PCP int `json:"pcp"`
		DCP int `json:"dcp"`
		PP  int `json:"pp"`
	} `json:"rank"`
	// Model is the model name and Fingerprint its layout digest.
	Model       string `json:"model"`
	Fingerprint string `json:"fingerprint"`
	// DataplaneURL is where the data plane is reached.
	DataplaneURL string `json:"dataplane_url"`
	// Groups describe each KV group's pool.
	Groups []pool.GroupStats `json:"groups"`
}

// mountAPI adds the inventory and pool routes.
func (a *App) mountAPI() {
	r := a.srv.Router()
	r.Get("/v1/devices", func(w http.ResponseWriter, _ *http.Request) {
		_ = httpserver.WriteJSON(w, http.StatusOK, a.gpus.Inventory()) // a failed write means the client left
	})
	r.Get("/v1/pool", a.getPool)
	r.With(a.srv.RequireAdmin()).Post("/v1/pool/reset", func(w http.ResponseWriter, r *http.Request) {
		a.pool.Reset()
		a.getPool(w, r)
	})
}

// getPool answers the pool's groups and occupancy.
func (a *App) getPool(w http.ResponseWriter, _ *http.Request) {
	ans := PoolAnswer{
		EngineID: a.cfg.EngineID, Model: a.model.Name, Fingerprint: a.model.Fingerprint(),
		DataplaneURL: a.worker.Addr, Groups: a.pool.Stats(a.model),
	}
	ans.Rank.TP, ans.Rank.PCP, ans.Rank.DCP, ans.Rank.PP = a.cfg.RankTP, a.cfg.RankPCP, a.cfg.RankDCP, a.cfg.RankPP
	_ = httpserver.WriteJSON(w, http.StatusOK, ans) // a failed write means the client left
}
