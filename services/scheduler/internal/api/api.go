// Package api is the scheduler's admin HTTP API: GET /v1/requests (a
// filtered, paginated list of request trackers),
// GET /v1/requests/{engine_id}/{request_id} (one request in full: tracker,
// per-group saved coverage, outstanding tasks, errors),
// GET /v1/outbox/failed (outbox rows that could not be published) and
// POST /v1/outbox/{id}/retry (an admin route putting one back on the relay
// path).
package api

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// States are the values the state filter accepts.
var States = []requeststate.TrackerState{
	requeststate.StateWaiting, requeststate.StateRunning, requeststate.StatePreempted,
	requeststate.StateFinishing, requeststate.StateDone, requeststate.StateErrored,
}

// API serves the admin routes.
type API struct {
	ledger *ledger.Ledger
	models *kvcore.Models
	outbox Outbox
	log    *slog.Logger
}

// New returns the API over l for the served models, with the outbox
// routes over o.
func New(l *ledger.Ledger, models *kvcore.Models, o Outbox, log *slog.Logger) *API {
	return &API{ledger: l, models: models, outbox: o, log: log}
}

// Mount adds the routes to r; admin guards the mutating one.
func (a *API) Mount(r chi.Router, admin func(http.Handler) http.Handler) {
	r.Get("/v1/requests", a.list)
	r.Get("/v1/requests/{engine_id}/{request_id}", a.show)
	r.Get("/v1/outbox/failed", a.listFailed)
	r.With(admin).Post("/v1/outbox/{id}/retry", a.retryFailed)
}

// Page is one page of GET /v1/requests: the requests in (engine id,
// request id) order.
type Page = adminapi.Page[adminapi.RequestSummary]

func (a *API) list(w http.ResponseWriter, r *http.Request) {
	f, ok := parseFilter(w, r)
	if !ok {
		return
	}
	want := f.Limit
	f.Limit++ // one more tells whether a next page exists
	rows, err := a.ledger.List(r.Context(), f)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	page := Page{Items: rows}
	if len(rows) > want {
		page.Items = rows[:want]
		last := rows[want-1]
		page.NextCursor = httpserver.EncodeCursor(ledger.Key{EngineID: last.EngineID, RequestID: last.RequestID})
	}
	a.write(w, page)
}

// parseFilter reads the query parameters, answering 400 naming a bad one.
func parseFilter(w http.ResponseWriter, r *http.Request) (ledger.Filter, bool) {
	q := r.URL.Query()
	f := ledger.Filter{EngineID: q.Get("engine_id"), State: q.Get("state")}
	if f.State != "" && !slices.Contains(States, requeststate.TrackerState(f.State)) {
		httpserver.BadParameter(w, r, "state", fmt.Sprintf("state %q is not one of %v", f.State, States))
		return f, false
	}
	var ok bool
	if f.Limit, ok = httpserver.PageLimit(w, r); !ok {
		return f, false
	}
	var k ledger.Key
	present, ok := httpserver.PageCursor(w, r, &k)
	if !ok {
		return f, false
	}
	if present {
		if k.EngineID == "" {
			v := q.Get(httpserver.ParamCursor)
			httpserver.BadParameter(w, r, httpserver.ParamCursor, fmt.Sprintf("cursor %q is %s", v, httpserver.ErrBadCursor))
			return f, false
		}
		f.After = &k
	}
	return f, true
}

// Detail is GET /v1/requests/{engine_id}/{request_id}.
type Detail = adminapi.RequestDetail

// Coverage is one group's saved coverage in a Detail.
type Coverage = adminapi.Coverage

func (a *API) show(w http.ResponseWriter, r *http.Request) {
	k, ok := pathKey(w, r)
	if !ok {
		return
	}
	row, err := a.ledger.Get(r.Context(), k)
	if errors.Is(err, ledger.ErrNotFound) {
		httpserver.WriteProblem(w, r, http.StatusNotFound, "", fmt.Sprintf("no tracker for request %q of engine %q", k.RequestID, k.EngineID), nil)
		return
	}
	if err != nil {
		a.internal(w, r, err)
		return
	}
	d, err := a.detail(row)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	a.write(w, d)
}

// pathKey reads the request's key from the path; ids may be
// percent-encoded (a request id containing "/").
func pathKey(w http.ResponseWriter, r *http.Request) (ledger.Key, bool) {
	var k ledger.Key
	for name, dst := range map[string]*string{"engine_id": &k.EngineID, "request_id": &k.RequestID} {
		v, err := url.PathUnescape(chi.URLParam(r, name))
		if err != nil || v == "" {
			httpserver.WriteProblem(w, r, http.StatusBadRequest, "", fmt.Sprintf("%s is not a valid path segment", name),
				map[string]any{"parameter": name})
			return k, false
		}
		*dst = v
	}
	return k, true
}

// detail builds the full view of a row.
func (a *API) detail(row *ledger.Row) (*Detail, error) {
	req, err := row.Request()
	if err != nil {
		return nil, err
	}
	t, x := req.Store, req.Extras
	d := &Detail{RequestSummary: row.RequestSummary, Tracker: toAPITracker(t), PDTracker: toAPITracker(x.PD),
		Tasks:     apiSlice(x.Tasks, func(r requeststate.TaskRef) adminapi.TaskRef { return adminapi.TaskRef(r) }),
		Held:      toAPIHeld(x.Held),
		Decisions: x.Decisions, AwaitingDecision: x.Awaiting, Errors: []adminapi.Warning{}}
	if d.Tasks == nil {
		d.Tasks = []adminapi.TaskRef{}
	}
	if sc := bus.ParseTraceparent(x.Traceparent); sc.IsValid() {
		d.TraceID = sc.TraceID().String()
	}
	if t.Error != "" {
		d.Errors = append(d.Errors, adminapi.Warning{Source: "request", Error: t.Error})
	}
	for _, w := range x.Warnings {
		d.Errors = append(d.Errors, adminapi.Warning(w))
	}
	d.Coverage = make([]Coverage, 0, len(x.Coverage))
	m, _ := a.models.Get(t.Model) // nil for a model no longer served: no kinds
	for _, c := range x.Coverage {
		v := Coverage{GroupCoverage: adminapi.GroupCoverage(c), EmittedTokens: t.NumSavedTokens}
		if m != nil && c.Group < len(m.Groups) {
			v.Kind = m.Groups[c.Group].Kind
		}
		d.Coverage = append(d.Coverage, v)
	}
	return d, nil
}

// internal answers 500 and logs the cause (the client sees no internals).
func (a *API) internal(w http.ResponseWriter, r *http.Request, err error) {
	a.log.ErrorContext(r.Context(), "admin API failed", "path", r.URL.Path, "err", err)
	httpserver.WriteProblem(w, r, http.StatusInternalServerError, "", "the request could not be served", nil)
}

// write answers 200 with v; an encoding failure was already answered.
func (a *API) write(w http.ResponseWriter, v any) {
	if err := httpserver.WriteJSON(w, http.StatusOK, v); err != nil {
		a.log.Error("admin API: encode response", "err", err)
	}
}
