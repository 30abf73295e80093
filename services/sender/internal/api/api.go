// Package api is the sender's HTTP API: the dead-letter queue (list, show,
// replay and its dry run), the accounting (stats) and the gpuworker
// registry it routes puts through (workers). services/sender/API.md and
// the service's OpenAPI document describe it for operators.
package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

// Sender is what the API needs from the sending side.
type Sender interface {
	// Replay replays one dead letter (see sending.Processor.Replay).
	Replay(ctx context.Context, id int64) (sending.Replayed, error)
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
	log     *slog.Logger
}

// New returns the API over the sending side s, the ledger l and the worker
// registry's view w.
func New(s Sender, l *ledger.Ledger, w *registry.View, log *slog.Logger) *API {
	return &API{sender: s, ledger: l, workers: w, log: log}
}

// Mount adds the routes to r; admin guards the mutating ones.
func (a *API) Mount(r chi.Router, admin func(http.Handler) http.Handler) {
	r.Get("/v1/dlq", a.list)
	r.Get("/v1/dlq/{id}", a.show)
	r.With(admin).Post("/v1/dlq/{id}/replay", a.replay)
	r.Get("/v1/stats", a.stats)
	r.Get("/v1/workers", a.listWorkers)
}

// Entry is a dead letter as the API shows it.
type Entry = adminapi.DeadLetterEntry

// Page is one page of GET /v1/dlq: the dead letters, newest first
// (payload omitted).
type Page = adminapi.Page[Entry]

func (a *API) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := ledger.Filter{Reason: q.Get("reason"), EngineID: q.Get("engine_id"), RequestID: q.Get("request_id")}
	var ok bool
	if f.Limit, ok = httpserver.PageLimit(w, r); !ok {
		return
	}
	if v := q.Get(httpserver.ParamCursor); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			httpserver.BadParameter(w, r, httpserver.ParamCursor, fmt.Sprintf("cursor %q is %s", v, httpserver.ErrBadCursor))
			return
		}
		f.Before = n
	}
	want := f.Limit
	f.Limit++ // one more tells whether a next page exists
	rows, err := a.ledger.List(r.Context(), f)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	next := len(rows) > want
	rows = rows[:min(len(rows), want)]
	page := Page{Items: make([]Entry, 0, len(rows))}
	for _, d := range rows {
		n := len(d.Payload)
		d.Payload = nil
		page.Items = append(page.Items, Entry{DeadLetter: d, PayloadBytes: n})
	}
	if next {
		page.NextCursor = strconv.FormatInt(rows[len(rows)-1].ID, 10)
	}
	a.write(w, http.StatusOK, page)
}

func (a *API) show(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	d, err := a.ledger.Get(r.Context(), id)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	e := Entry{DeadLetter: d, PayloadBytes: len(d.Payload)}
	if json.Valid(d.Payload) {
		e.PayloadJSON = d.Payload
	}
	a.write(w, http.StatusOK, e)
}

// ReplayAnswer is the answer of POST /v1/dlq/{id}/replay.
type ReplayAnswer = adminapi.ReplayAnswer

// DryRunAnswer is the answer of POST /v1/dlq/{id}/replay?dry_run=true.
type DryRunAnswer = adminapi.DryRunAnswer

func (a *API) replay(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	dry, ok := dryRunParam(w, r)
	if !ok {
		return
	}
	if dry {
		a.dryRun(w, r, id)
		return
	}
	out, err := a.sender.Replay(r.Context(), id)
	var invalid *sending.InvalidError
	switch {
	case errors.As(err, &invalid):
		httpserver.WriteProblem(w, r, http.StatusUnprocessableEntity, "Dead letter still invalid", invalid.Detail,
			map[string]any{"reason": invalid.Reason, "group": invalid.Group, "dead_letter_id": id})
		return
	case errors.Is(err, sending.ErrReplayFailed):
		httpserver.WriteProblem(w, r, http.StatusServiceUnavailable, "Replay did not complete", err.Error(),
			map[string]any{"reason": out.Result.Reason, "result": out.Result, "dead_letter_id": id})
		return
	case err != nil:
		a.fail(w, r, err)
		return
	}
	a.write(w, http.StatusOK, ReplayAnswer{ID: id, ReplayStatus: out.DeadLetter.ReplayStatus,
		ReplayCount: out.DeadLetter.ReplayCount, AlreadyReplayed: out.Already, Result: out.Result})
}

// dryRunParam reads the dry_run query parameter (a boolean, default false).
func dryRunParam(w http.ResponseWriter, r *http.Request) (bool, bool) {
	v := r.URL.Query().Get("dry_run")
	if v == "" {
		return false, true
	}
	dry, err := strconv.ParseBool(v)
	if err != nil {
		httpserver.BadParameter(w, r, "dry_run", fmt.Sprintf("dry_run %q is not true or false", v))
		return false, false
	}
	return dry, true
}

// dryRun answers what a replay of id would do, changing nothing.
func (a *API) dryRun(w http.ResponseWriter, r *http.Request, id int64) {
	d, err := a.sender.DryRun(r.Context(), id)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	a.write(w, http.StatusOK, DryRunAnswer{ID: id, Simulated: true, ReplayStatus: d.DeadLetter.ReplayStatus,
		ReplayCount: d.DeadLetter.ReplayCount, DryRun: d.DryRun})
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

func pathID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	v := chi.URLParam(r, "id")
	id, err := strconv.ParseInt(v, 10, 64)
	if err != nil || id < 1 {
		httpserver.BadParameter(w, r, "id", fmt.Sprintf("dead letter id %q is not a positive integer", v))
		return 0, false
	}
	return id, true
}

// fail answers err: 404 for an unknown dead letter, else 500.
func (a *API) fail(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, ledger.ErrNotFound) {
		httpserver.WriteProblem(w, r, http.StatusNotFound, "", err.Error(), nil)
		return
	}
	a.internal(w, r, err)
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
