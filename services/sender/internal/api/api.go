// Package api is the sender's HTTP API: the dead-letter queue (list, show,
// replay and its dry run; the shared routes of pkg/deadletter/dlqhttp),
// the accounting (stats), the gpuworker
// registry it routes puts through (workers), the store's removals and the
// tenants' quotas. services/sender/API.md and
// the service's OpenAPI document describe it for operators.
package api

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/deadletter/dlqhttp"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/quotas"
	"github.com/kvmesh/kvmesh/services/sender/internal/removals"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

// Sender is what the API needs from the sending side.
type Sender interface {
	// Replay replays one dead letter (see sending.Processor.Replay).
	Replay(ctx context.Context, id int64) (deadletter.Replayed, error)
	// DryRun says what Replay would do now (see sending.Processor.DryRun).
	DryRun(ctx context.Context, id int64) (sending.DryRun, error)
	// Pressure returns the pressure gate's state.
	Pressure() sending.PressureState
}

// API serves the sender's routes.
type API struct {
	sender  Sender
	ledger  *ledger.Ledger
	workers *registry.View
	removed *removals.Log
	quotas  *quotas.Enforcer
	log     *slog.Logger
}

// New returns the API over the sending side s, the ledger l and the worker
// registry's view w.
func New(s Sender, l *ledger.Ledger, w *registry.View, log *slog.Logger) *API {
	return &API{sender: s, ledger: l, workers: w, log: log}
}

// WithRemovals serves the store's removals from log (GET /v1/removals).
func (a *API) WithRemovals(log *removals.Log) *API {
	a.removed = log
	return a
}

// Mount adds the routes to r; admin guards the mutating ones and the
// removals (which name every tenant's). The
// dead-letter routes are the shared ones (pkg/deadletter/dlqhttp) over the
// sender's rows, with the sender's replay and its dry run.
func (a *API) Mount(r chi.Router, admin func(http.Handler) http.Handler) {
	dlqhttp.New(a.ledger.DeadLetters(), a.sender, a.log).WithDryRun(a.dryRun).Mount(r, nil, admin)
	r.Get("/v1/stats", a.stats)
	r.Get("/v1/workers", a.listWorkers)
	if a.removed != nil {
		r.With(admin).Get("/v1/removals", a.listRemovals)
	}
	a.mountQuotas(r, admin)
}

// Stats is the answer of GET /v1/stats.
type Stats = adminapi.SenderStats

func (a *API) stats(w http.ResponseWriter, r *http.Request) {
	s, err := a.ledger.Stats(r.Context())
	if err != nil {
		a.internal(w, r, err)
		return
	}
	a.write(w, http.StatusOK, Stats{Accounting: s, Pressure: a.sender.Pressure(), At: time.Now().UTC()})
}

// DryRunAnswer is the answer of POST /v1/dlq/{id}/replay?dry_run=true.
type DryRunAnswer = adminapi.DryRunAnswer

// dryRun answers what a replay of id would do, changing nothing.
func (a *API) dryRun(ctx context.Context, id int64) (any, error) {
	d, err := a.sender.DryRun(ctx, id)
	if err != nil {
		return nil, err
	}
	return DryRunAnswer{ID: id, Simulated: true, ReplayStatus: d.DeadLetter.ReplayStatus,
		ReplayCount: d.DeadLetter.ReplayCount, DryRun: d.DryRun}, nil
}

func (a *API) internal(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		httpserver.WriteProblem(w, r, http.StatusServiceUnavailable, "", "the request was cancelled", nil)
		return
	}
	a.log.ErrorContext(r.Context(), "sender api failed", "path", r.URL.Path, "err", err)
	httpserver.WriteProblem(w, r, http.StatusInternalServerError, "", "the sender could not answer; see its log", nil)
}

func (a *API) write(w http.ResponseWriter, status int, v any) {
	if err := httpserver.WriteJSON(w, status, v); err != nil {
		a.log.Error("sender api: encode answer", "err", err)
	}
}
