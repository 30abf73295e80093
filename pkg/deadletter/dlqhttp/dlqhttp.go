// Package dlqhttp serves the dead-letter admin routes every consuming
// service mounts over its pkg/deadletter Store, with the same paths and
// JSON in each: GET /v1/dlq (one page, newest first, filtered by reason,
// engine_id and request_id), GET /v1/dlq/{id} (one entry with its original
// record) and POST /v1/dlq/{id}/replay (admin only; the service's
// Replayer, and, where the service has one, its dry run).
package dlqhttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Replayer replays one dead letter of the service. Errors:
// deadletter.ErrNotFound (404); a *deadletter.InvalidError (422);
// deadletter.ErrReplayFailed, with the recorded result (503).
type Replayer interface {
	// Replay replays dead letter id and records the attempt.
	Replay(ctx context.Context, id int64) (deadletter.Replayed, error)
}

// DryRunFunc answers what a replay of id would do, changing nothing (the
// answer of POST /v1/dlq/{id}/replay?dry_run=true).
type DryRunFunc func(ctx context.Context, id int64) (any, error)

// Page is one page of GET /v1/dlq: the dead letters, newest first
// (payload omitted).
type Page = adminapi.Page[deadletter.Entry]

// API serves the dead-letter routes of one service.
type API struct {
	store    *deadletter.Store
	replayer Replayer
	dryRun   DryRunFunc
	log      *slog.Logger
	// service names the service in problems and logs.
	service string
}

// New returns the routes over store, replaying through replayer.
func New(store *deadletter.Store, replayer Replayer, log *slog.Logger) *API {
	a := &API{store: store, replayer: replayer, log: log, service: "service"}
	if store != nil {
		a.service = store.Service()
	}
	return a
}

// WithDryRun makes ?dry_run=true answer f; without it a dry run is a bad
// parameter.
func (a *API) WithDryRun(f DryRunFunc) *API {
	a.dryRun = f
	return a
}

// Mount adds the routes to r: read guards the two reads (nil: the
// server's own authentication alone, as on the sender, which takes only the
// operator token), admin guards the replay. A service that also takes
// engine tokens passes its admin guard for both.
func (a *API) Mount(r chi.Router, read, admin func(http.Handler) http.Handler) {
	rr := r
	if read != nil {
		rr = r.With(read)
	}
	rr.Get("/v1/dlq", a.list)
	rr.Get("/v1/dlq/{id}", a.show)
	r.With(admin).Post("/v1/dlq/{id}/replay", a.replay)
}

func (a *API) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := deadletter.Filter{Reason: kvcore.Reason(q.Get("reason")), EngineID: q.Get("engine_id"), RequestID: q.Get("request_id")}
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
	rows, err := a.store.List(r.Context(), f)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	next := len(rows) > want
	rows = rows[:min(len(rows), want)]
	page := Page{Items: make([]deadletter.Entry, 0, len(rows))}
	for _, d := range rows {
		n := len(d.Payload)
		d.Payload = nil
		page.Items = append(page.Items, deadletter.Entry{DeadLetter: d, PayloadBytes: n})
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
	d, err := a.store.Get(r.Context(), id)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	e := deadletter.Entry{DeadLetter: d, PayloadBytes: len(d.Payload)}
	if json.Valid(d.Payload) {
		e.PayloadJSON = d.Payload
	}
	a.write(w, http.StatusOK, e)
}

func (a *API) replay(w http.ResponseWriter, r *http.Request) {
	id, ok := pathID(w, r)
	if !ok {
		return
	}
	dry, ok := a.dryRunParam(w, r)
	if !ok {
		return
	}
	if dry {
		out, err := a.dryRun(r.Context(), id)
		if err != nil {
			a.fail(w, r, err)
			return
		}
		a.write(w, http.StatusOK, out)
		return
	}
	out, err := a.replayer.Replay(r.Context(), id)
	var invalid *deadletter.InvalidError
	switch {
	case errors.As(err, &invalid):
		httpserver.WriteProblem(w, r, http.StatusUnprocessableEntity, "Dead letter still invalid", invalid.Detail,
			map[string]any{"reason": invalid.Reason, "group": invalid.Group, "dead_letter_id": id})
		return
	case errors.Is(err, deadletter.ErrReplayFailed):
		httpserver.WriteProblem(w, r, http.StatusServiceUnavailable, "Replay did not complete", err.Error(),
			map[string]any{"reason": out.Result.Reason, "result": out.Result, "dead_letter_id": id})
		return
	case err != nil:
		a.fail(w, r, err)
		return
	}
	a.write(w, http.StatusOK, deadletter.ReplayAnswer{ID: id, ReplayStatus: out.DeadLetter.ReplayStatus,
		ReplayCount: out.DeadLetter.ReplayCount, AlreadyReplayed: out.Already, Result: out.Result})
}

// dryRunParam reads the dry_run query parameter (a boolean, default
// false; true only where the service has a dry run).
func (a *API) dryRunParam(w http.ResponseWriter, r *http.Request) (bool, bool) {
	v := r.URL.Query().Get("dry_run")
	if v == "" {
		return false, true
	}
	dry, err := strconv.ParseBool(v)
	if err != nil {
		httpserver.BadParameter(w, r, "dry_run", fmt.Sprintf("dry_run %q is not true or false", v))
		return false, false
	}
	if dry && a.dryRun == nil {
		httpserver.BadParameter(w, r, "dry_run", "the "+a.service+" has no dry run of a replay")
		return false, false
	}
	return dry, true
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
	if errors.Is(err, deadletter.ErrNotFound) {
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
	a.log.ErrorContext(r.Context(), a.service+" api failed", "path", r.URL.Path, "err", err)
	httpserver.WriteProblem(w, r, http.StatusInternalServerError, "", "the "+a.service+" could not answer; see its log", nil)
}

func (a *API) write(w http.ResponseWriter, status int, v any) {
	if err := httpserver.WriteJSON(w, status, v); err != nil {
		a.log.Error(a.service+" api: encode answer", "err", err)
	}
}
