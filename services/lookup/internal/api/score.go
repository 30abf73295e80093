package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
	"github.com/kvmesh/kvmesh/services/lookup/internal/engines"
)

// ScoreRoute is the scoring route: how much of a prompt the store holds,
// group by group, for a router choosing an engine.
const ScoreRoute = "/v1/score"

// Values of the outcome label of kvmesh_lookup_scores_total.
const (
	// ScoreHit: answered with the store's hit_tokens > 0.
	ScoreHit = "hit"
	// ScoreMiss: answered with the store's hit_tokens 0.
	ScoreMiss = "miss"
	// ScoreInvalid: refused with a 4xx.
	ScoreInvalid = "invalid"
	// ScoreStoreFailed: the store could not be checked; 503.
	ScoreStoreFailed = "store_failed"
	// ScoreError: an unexpected failure; 500.
	ScoreError = "error"
)

// Errors of the score handler.
var (
	// ErrScoreOptions is returned by NewScore for options without a model
	// or store.
	ErrScoreOptions = errors.New("score api: model and store are required")
)

// Exister answers which keys the store holds; kvstore.Store is one.
type Exister interface {
	// Exists reports, for each key, whether the store holds it.
	Exists(ctx context.Context, keys []string) ([]bool, error)
}

// ScoreModel is one more model a score handler serves beside its
// default: its layout and its keys.
type ScoreModel struct {
	Model *kvcore.Model
	Keys  kvcore.KeyBuilder
}

// ScoreOptions configures the score handler.
type ScoreOptions struct {
	// Model is the default served model.
	Model *kvcore.Model
	// Keys builds the default model's store keys (prefix, model name and
	// fingerprint); each score uses its tenant's (KeyBuilder.ForTenant).
	Keys kvcore.KeyBuilder
	// More are the other served models (KVMESH_MODELS); their scores are
	// the store's alone (Engines index the default model's engines).
	More []ScoreModel
	// Store is the store pool.
	Store Exister
	// Common: Timeout bounds one score's store check; Registry receives
	// kvmesh_lookup_scores_total; Log store failures.
	Common
	// Engines is the engines' own prefix caches, from their KV events
	// (KVMESH_LOOKUP_ENGINE_SCORES); nil scores the store alone.
	Engines EngineIndex
}

// EngineIndex is the engines' prefix caches; *engines.Index is one.
type EngineIndex interface {
	// Each calls fn for every engine with its presence by group and wire
	// hash.
	Each(fn func(engine string, has engines.Presence))
}

// ScoreHandler serves POST /v1/score. Scoring has no side effects: nothing
// is published and no decision is made.
type ScoreHandler struct {
	opts   ScoreOptions
	served map[string]scored
	names  []string // the served models' names, the default first
	scores *prometheus.CounterVec
}

// scored is what a score handler serves one model with.
type scored struct {
	validator Validator
	keys      kvcore.KeyBuilder
}

// NewScore returns the score handler, registering its counter on
// opts.Registry.
func NewScore(opts ScoreOptions) (*ScoreHandler, error) {
	if opts.Model == nil || opts.Store == nil {
		return nil, ErrScoreOptions
	}
	opts.Common = opts.Common.withDefaults()
	scores := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_lookup_scores_total",
		Help: "POST /v1/score requests, by outcome (hit, miss, invalid, store_failed, error); hit and miss say whether the store's hit_tokens was positive.",
	}, []string{"outcome"})
	if err := opts.Registry.Register(scores); err != nil {
		return nil, fmt.Errorf("score metrics: %w", err)
	}
	for _, o := range []string{ScoreHit, ScoreMiss, ScoreInvalid, ScoreStoreFailed, ScoreError} {
		scores.WithLabelValues(o)
	}
	h := &ScoreHandler{opts: opts, served: map[string]scored{}, scores: scores}
	for _, m := range append([]ScoreModel{{Model: opts.Model, Keys: opts.Keys}}, opts.More...) {
		if m.Model == nil {
			return nil, ErrScoreOptions
		}
		h.served[m.Model.Name] = scored{validator: Validator{Model: m.Model}, keys: m.Keys}
		h.names = append(h.names, m.Model.Name)
	}
	return h, nil
}

// Mount adds POST /v1/score, with its body limit, to r.
func (h *ScoreHandler) Mount(r chi.Router) {
	r.With(httpserver.BodyLimit(h.opts.MaxBodyBytes)).Post(ScoreRoute, h.ServeHTTP)
}

// ServeHTTP answers one score: 200 with the store's score; 4xx problem
// naming the bad field; 403 for a tenant the credential does not serve;
// 503 with Retry-After when the store cannot be checked (never a guessed
// score).
func (h *ScoreHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, span := otel.GetTracerProvider().Tracer(tracerName).Start(r.Context(), "score")
	defer span.End()
	r = r.WithContext(ctx)
	var req Request
	if err := decodeRequest(w, r, &req, h.opts.MaxBodyBytes); err != nil {
		h.refuse(span, err)
		return
	}
	span.SetAttributes(attribute.String("kvmesh.model", req.Model), attribute.String("kvmesh.tenant", req.Tenant))
	if err := allowedScore(ctx, &req); err != nil {
		httpserver.WriteProblem(w, r, http.StatusForbidden, "", err.Error(), nil)
		h.refuse(span, err)
		return
	}
	sm, err := modelOf(h.served, h.names, req.Model)
	if err != nil {
		writeFieldError(w, r, err)
		h.refuse(span, err)
		return
	}
	q, err := sm.validator.ScoreQuery(&req)
	if err != nil {
		writeFieldError(w, r, err)
		h.refuse(span, err)
		return
	}
	plan, s, err := h.score(ctx, sm, q)
	if err != nil {
		h.fail(w, r, span, err)
		return
	}
	h.answered(span, s)
	res := &adminapi.ScoreResponse{Model: req.Model, Tenant: q.Tenant, NumTokens: q.NumTokens, Store: tierScore(s)}
	if h.opts.Engines != nil && req.Model == h.opts.Model.Name && seesEveryTenant(ctx) {
		res.Engines = engineScores(plan, h.opts.Engines)
	}
	_ = httpserver.WriteJSON(w, http.StatusOK, res)
}

// engineScores scores the plan's prompt against every engine's prefix
// cache; nil when no engine published.
func engineScores(plan *kvcore.ScorePlan, idx EngineIndex) map[string]adminapi.TierScore {
	var out map[string]adminapi.TierScore
	idx.Each(func(engine string, has engines.Presence) {
		if out == nil {
			out = map[string]adminapi.TierScore{}
		}
		out[engine] = tierScore(plan.ScorePresence(func(g int, h kvcore.BlockHash) bool {
			return has(g, contract.WireHash(h))
		}))
	})
	return out
}

// score checks every key of the prompt's score plan in one batch, under
// the timeout. A failed check is an error wrapping connector.ErrStore.
func (h *ScoreHandler) score(ctx context.Context, sm scored, q *connector.Query) (*kvcore.ScorePlan, kvcore.Score, error) {
	plan, err := kvcore.PlanScore(sm.validator.Model, sm.keys.ForTenant(q.Tenant), q.Hashes, q.NumTokens)
	if err != nil {
		return nil, kvcore.Score{}, fmt.Errorf("plan: %w", err)
	}
	var exists []bool
	if keys := plan.Keys(); len(keys) > 0 {
		sctx, cancel := context.WithTimeout(ctx, h.opts.Timeout)
		defer cancel()
		if exists, err = h.opts.Store.Exists(sctx, keys); err != nil {
			return nil, kvcore.Score{}, fmt.Errorf("%w (%d keys): %w", connector.ErrStore, len(keys), err)
		}
	}
	s, err := plan.Score(exists)
	return plan, s, err
}

// tierScore is s in the answer's form, kinds named as vLLM names them.
func tierScore(s kvcore.Score) adminapi.TierScore {
	out := adminapi.TierScore{HitTokens: s.HitTokens, AnyGroupPrefixTokens: s.AnyGroupPrefixTokens, Groups: make([]adminapi.GroupScore, len(s.Groups))}
	for i, g := range s.Groups {
		out.Groups[i] = adminapi.GroupScore{Group: g.Group, Kind: contract.SpecKind(g.Kind), BlockSize: g.BlockSize, PrefixTokens: g.PrefixTokens, UsableTokens: g.UsableTokens}
	}
	return out
}

// answered records a served score.
func (h *ScoreHandler) answered(span trace.Span, s kvcore.Score) {
	outcome := ScoreMiss
	if s.HitTokens > 0 {
		outcome = ScoreHit
	}
	h.scores.WithLabelValues(outcome).Inc()
	span.SetAttributes(attribute.Int("kvmesh.hit_tokens", s.HitTokens), attribute.Int("kvmesh.any_group_prefix_tokens", s.AnyGroupPrefixTokens))
}

// refuse records a score refused with a 4xx (the response is written).
func (h *ScoreHandler) refuse(span trace.Span, err error) {
	h.scores.WithLabelValues(ScoreInvalid).Inc()
	span.AddEvent("invalid request", trace.WithAttributes(attribute.String("error", err.Error())))
}

// fail answers a score that could not be computed: 503 with Retry-After
// when the store could not be checked (its status in the problem's reason
// member), 500 otherwise.
func (h *ScoreHandler) fail(w http.ResponseWriter, r *http.Request, span trace.Span, err error) {
	span.RecordError(err)
	if !errors.Is(err, connector.ErrStore) {
		h.scores.WithLabelValues(ScoreError).Inc()
		span.SetStatus(codes.Error, ScoreError)
		h.opts.Log.ErrorContext(r.Context(), "score failed", "err", err)
		httpserver.WriteProblem(w, r, http.StatusInternalServerError, "", "the score failed unexpectedly", map[string]any{"result": ScoreError})
		return
	}
	h.scores.WithLabelValues(ScoreStoreFailed).Inc()
	span.SetStatus(codes.Error, ScoreStoreFailed)
	reason := kvstore.FailureStatus(err)
	h.opts.Log.WarnContext(r.Context(), "score: store check failed; answered 503", "reason", reason, "err", err)
	w.Header().Set("Retry-After", strconv.Itoa(RetryAfter))
	httpserver.WriteProblem(w, r, http.StatusServiceUnavailable, "",
		"the store could not be checked; no score is guessed: retry after Retry-After seconds, or score engines without the store tier",
		map[string]any{"result": ScoreStoreFailed, "reason": reason})
}

// ScoreQuery validates a score request: the lookup's prompt forms, model
// and tenant, with engine_id and request_id optional (a router scores
// before it picks an engine; when given they are checked as the lookup
// checks them). The lookup-only fields num_computed_tokens,
// kv_transfer_params and load_async are refused. It returns the query or
// a *FieldError naming the first bad field.
func (v Validator) ScoreQuery(req *Request) (*connector.Query, error) {
	if err := checkScoreFields(req); err != nil {
		return nil, err
	}
	if err := v.checkScope(req); err != nil {
		return nil, err
	}
	q := &connector.Query{EngineID: req.EngineID, RequestID: req.RequestID, Tenant: req.Tenant}
	if err := v.hashInput(req, q); err != nil {
		return nil, err
	}
	return q, nil
}

// checkScoreFields checks the optional ids and refuses the lookup-only
// fields.
func checkScoreFields(req *Request) *FieldError {
	for _, id := range []struct{ field, v string }{{"engine_id", req.EngineID}, {"request_id", req.RequestID}} {
		if id.v != "" {
			if err := checkID(id.field, id.v); err != nil {
				return err
			}
		}
	}
	const only = "only applies to POST /v1/lookup: a score makes no decision"
	switch {
	case req.NumComputedTokens != 0:
		return fieldErr("num_computed_tokens", only)
	case req.KVTransferParams != nil:
		return fieldErr("kv_transfer_params", only)
	case req.LoadAsync != nil:
		return fieldErr("load_async", only)
	}
	return nil
}
