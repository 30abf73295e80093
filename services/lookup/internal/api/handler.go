// Package api is the lookup service's HTTP API: POST /v1/lookup validates
// an engine's lookup, runs the connector chain, publishes the decision to
// kvmesh.lookup.decisions and answers with it. API.md (next to the
// service's main) describes the route for engine authors.
package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
)

// Route is the lookup route.
const Route = "/v1/lookup"

// RetryAfter is the Retry-After a 503 carries, in seconds.
const RetryAfter = 1

// Defaults for zero Options fields, and of the lookup's
// KVMESH_LOOKUP_TIMEOUT and KVMESH_LOOKUP_MAX_BODY_BYTES.
const (
	// DefaultTimeout bounds one lookup's chain and decision publish.
	DefaultTimeout = 2 * time.Second
	// DefaultMaxBodyBytes limits a lookup request body.
	DefaultMaxBodyBytes int64 = 4 << 20
)

// tracerName names the tracer of lookup spans.
const tracerName = "kvmesh/lookup"

// Errors of the handler.
var (
	// ErrOptions is returned by New for Options without a model, chain or
	// publisher.
	ErrOptions = errors.New("lookup api: model, chain and publisher are required")
	// ErrNoHead is a binary body (ContentTypeBinary) without a '\n' after
	// its JSON head.
	ErrNoHead = errors.New("a binary lookup body is a one-line JSON head, a '\\n', then the raw hashes; no '\\n' found")
)

// DecisionProducerOptions are the options of the producer a lookup
// publishes its decisions with: batches of one message, so that a publish
// is sent at once instead of after the batch timeout (which, at under a
// millisecond, can take a millisecond to fire). The engine waits for each
// decision's ack (no decision is answered that the scheduler may not
// receive), so batching would only add to every lookup's latency.
func DecisionProducerOptions() []bus.ProducerOption {
	return []bus.ProducerOption{bus.WithBatchSize(1)}
}

// Publisher publishes decisions; *bus.Producer is one.
type Publisher interface {
	// Publish writes msgs and returns once the brokers acknowledged them.
	Publish(ctx context.Context, msgs ...bus.Message) error
}

// Served is one more model a handler serves beside its default: its
// layout and its connector chain (of its keys).
type Served struct {
	Model *kvcore.Model
	Chain *connector.Chain
}

// Options configures the handler.
type Options struct {
	// Model is the default served model.
	Model *kvcore.Model
	// Chain is the default model's connector chain.
	Chain *connector.Chain
	// More are the other served models (KVMESH_MODELS), each looked up
	// with its own layout and keys.
	More []Served
	// Publisher publishes decisions to kvmesh.lookup.decisions.
	Publisher Publisher
	// Enabled is false when lookups are disabled: every lookup is then
	// answered 0 with no LoadSpec and no child is asked.
	Enabled bool
	// LoadAsync is the default load_async.
	LoadAsync bool
	// Common: Timeout bounds the chain (the store check) of one lookup,
	// and then, on its own, the publish of its decision, so that a store
	// check that runs out of time still leaves the publish its whole
	// bound; Registry receives the lookup metrics; Log child (store) and
	// publish failures.
	Common
}

// Common are the options both handlers of the lookup's API take, with
// their defaults in one place (withDefaults).
type Common struct {
	// Timeout bounds one request's store check; default DefaultTimeout.
	Timeout time.Duration
	// MaxBodyBytes limits the request body; default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// Registry receives the handler's metrics; default a registry of its own.
	Registry prometheus.Registerer
	// Log receives store and publish failures; default discards.
	Log *slog.Logger
}

// withDefaults fills c's zero fields.
func (c Common) withDefaults() Common {
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
	}
	return c
}

// Handler serves POST /v1/lookup.
type Handler struct {
	opts Options
	// served are the validator and chain of each served model, by name.
	served  map[string]served
	names   []string // the served models' names, the default first
	metrics *metrics
	// childFailures is kvmesh_lookup_child_failures_total{child,reason}.
	childFailures *prometheus.CounterVec
}

// New returns the handler, registering its metrics on opts.Registry.
func New(opts Options) (*Handler, error) {
	if opts.Model == nil || opts.Chain == nil || opts.Publisher == nil {
		return nil, ErrOptions
	}
	opts.Common = opts.Common.withDefaults()
	h := &Handler{opts: opts, served: map[string]served{}}
	for _, s := range append([]Served{{Model: opts.Model, Chain: opts.Chain}}, opts.More...) {
		if s.Model == nil || s.Chain == nil {
			return nil, ErrOptions
		}
		h.served[s.Model.Name] = served{validator: Validator{Model: s.Model, LoadAsync: opts.LoadAsync}, chain: s.Chain}
		h.names = append(h.names, s.Model.Name)
	}
	var err error
	if h.metrics, err = newMetrics(opts.Registry, h.names); err != nil {
		return nil, err
	}
	if h.childFailures, err = newChildFailures(opts.Registry, opts.Chain.Names()); err != nil {
		return nil, err
	}
	return h, nil
}

// served is what a handler serves one model with.
type served struct {
	validator Validator
	chain     *connector.Chain
}

// modelOf is what serves model among byName, or a *FieldError naming the served
// ones: a model the mesh does not serve is refused, never looked up in
// another model's keys.
func modelOf[T any](byName map[string]T, names []string, model string) (T, error) {
	s, ok := byName[model]
	if !ok {
		return s, fieldErr("model", "model %q is not served here; this mesh serves %s", model, strings.Join(names, ", "))
	}
	return s, nil
}

// Mount adds POST /v1/lookup, with its body limit, to r.
func (h *Handler) Mount(r chi.Router) {
	r.With(httpserver.BodyLimit(h.opts.MaxBodyBytes)).Post(Route, h.ServeHTTP)
}

// ServeHTTP answers one lookup: 200 with the decision; 4xx problem naming
// the bad field; 503 with Retry-After when the decision cannot be
// published (no decision is answered that the scheduler did not receive).
// A store outage is not a 503: the store child fails open and answers 0
// (the chain goes on, so a pd hit still wins), counted in
// kvmesh_lookup_child_failures_total and logged at WARN with the error
// and the request's trace; the decision names the failed child.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	ctx, span := otel.GetTracerProvider().Tracer(tracerName).Start(r.Context(), "lookup")
	defer span.End()
	r = r.WithContext(ctx)
	var req Request
	if err := h.decode(w, r, &req); err != nil {
		h.refuse(span, "", err)
		return
	}
	span.SetAttributes(
		attribute.String(telemetry.AttrEngineID, req.EngineID),
		attribute.String(telemetry.AttrRequestID, req.RequestID),
		attribute.String("kvmesh.model", req.Model),
		attribute.String("kvmesh.tenant", req.Tenant),
	)
	if err := allowed(ctx, &req); err != nil {
		httpserver.WriteProblem(w, r, http.StatusForbidden, "", err.Error(), nil)
		h.refuse(span, "credential", err)
		return
	}
	s, err := modelOf(h.served, h.names, req.Model)
	if err != nil {
		h.refuse(span, writeFieldError(w, r, err), err)
		return
	}
	q, err := s.validator.Query(&req)
	if err != nil {
		h.refuse(span, writeFieldError(w, r, err), err)
		return
	}
	span.SetAttributes(attribute.Int("kvmesh.tokens", q.NumTokens))
	d, result, err := h.lookup(ctx, s.chain, q, req.Model)
	if err != nil {
		h.fail(w, r, span, result, err)
		return
	}
	h.answered(span, d, result, time.Since(start))
	_ = httpserver.WriteJSON(w, http.StatusOK, d) // a failed write is the client's loss; nothing to undo
}

// decode reads the request body, JSON or binary (ContentTypeBinary); on
// failure it has written the problem.
func (h *Handler) decode(w http.ResponseWriter, r *http.Request, req *Request) error {
	return decodeRequest(w, r, req, h.opts.MaxBodyBytes)
}

// decodeRequest reads a lookup body, JSON or binary (ContentTypeBinary),
// of at most limit bytes; on failure it has written the problem.
func decodeRequest(w http.ResponseWriter, r *http.Request, req *Request, limit int64) error {
	if isBinary(r.Header.Get("Content-Type")) {
		return decodeBinary(w, r, req, limit)
	}
	return httpserver.DecodeJSON(w, r, req)
}

// lookup runs the chain and publishes the decision. On failure it returns
// the result label of the failure.
//
// A child whose check failed answered 0 and the chain went on (fail open,
// per child). Publishing the decision is no child: vLLM's scheduler has
// no equivalent step (get_num_new_matched_tokens answers in-process), and
// the scheduler of the mesh learns what the engine was told only from
// this record, so a decision that was not published is never answered
// (503 publish_failed) — an engine acting on it would allocate for a load
// that no tracker expects.
func (h *Handler) lookup(ctx context.Context, chain *connector.Chain, q *connector.Query, model string) (*contract.LookupDecision, string, error) {
	var res connector.Result
	if h.opts.Enabled {
		var err error
		if res, err = h.runChain(ctx, chain, q); err != nil {
			return nil, ResultError, err
		}
	} else {
		res.Selection = kvcore.Selection{Chosen: kvcore.NoChild}
	}
	d := buildDecision(newDecisionID(), model, q, res)
	value, err := json.Marshal(d)
	if err != nil {
		return nil, ResultError, fmt.Errorf("encode decision: %w", err)
	}
	msg := bus.Message{Topic: contract.TopicLookupDecisions, Key: q.RequestID, Value: value}
	pctx, cancel := context.WithTimeout(ctx, h.opts.Timeout)
	defer cancel()
	if err := h.opts.Publisher.Publish(pctx, msg); err != nil {
		return nil, ResultPublishFailed, err
	}
	return d, h.resultOf(d), nil
}

// runChain asks chain under the lookup's timeout, then counts and logs
// every child that failed open.
func (h *Handler) runChain(ctx context.Context, chain *connector.Chain, q *connector.Query) (connector.Result, error) {
	cctx, cancel := context.WithTimeout(ctx, h.opts.Timeout)
	defer cancel()
	res, err := chain.Lookup(cctx, q)
	if err != nil {
		return connector.Result{}, err
	}
	for _, i := range res.Failures() {
		a := res.Answers[i]
		reason := a.FailureReason()
		h.childFailures.WithLabelValues(res.Names[i], reason).Inc()
		trace.SpanFromContext(ctx).AddEvent("child failed open", trace.WithAttributes(
			attribute.String("kvmesh.child", res.Names[i]), attribute.String("kvmesh.reason", reason),
			attribute.String("error", a.Failed.Error())))
		h.opts.Log.WarnContext(ctx, "lookup child failed; answered 0 (fail open)",
			"child", res.Names[i], "reason", reason, "engine_id", q.EngineID, "request_id", q.RequestID, "err", a.Failed)
	}
	return res, nil
}

// resultOf labels an answered decision.
func (h *Handler) resultOf(d *contract.LookupDecision) string {
	switch {
	case !h.opts.Enabled:
		return ResultDisabled
	case d.Pending:
		return ResultPending
	case d.ExternalTokens > 0:
		return ResultHit
	default:
		return ResultMiss
	}
}

// buildDecision turns the chain's result into the decision the scheduler
// receives and the engine is answered with.
func buildDecision(id, model string, q *connector.Query, res connector.Result) *contract.LookupDecision {
	d := &contract.LookupDecision{
		Schema:            contract.SchemaLookupDecision,
		DecisionID:        id,
		EngineID:          q.EngineID,
		RequestID:         q.RequestID,
		Model:             model,
		Tenant:            q.Tenant,
		NumTokens:         q.NumTokens,
		NumComputedTokens: q.NumComputedTokens,
		Pending:           res.Selection.Pending,
		Children:          make([]contract.ChildDecision, len(res.Answers)),
	}
	for i, a := range res.Answers {
		d.Children[i] = contract.ChildDecision{Name: res.Names[i], Tokens: a.Tokens, Pending: a.Pending, Spec: a.Spec, Failed: a.FailureReason()}
	}
	if chosen, ok := res.Chosen(); ok && !d.Pending {
		d.Chosen = res.Names[res.Selection.Chosen]
		d.ExternalTokens = res.Selection.Tokens
		d.LoadAsync = chosen.Async
		if d.Chosen == connector.NamePD {
			d.PD = chosen.PD
		}
	}
	return d
}

// newDecisionID returns 16 random bytes in hex.
func newDecisionID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (it panics instead)
	return hex.EncodeToString(b[:])
}

// answered records a served lookup.
func (h *Handler) answered(span trace.Span, d *contract.LookupDecision, result string, elapsed time.Duration) {
	h.metrics.requests.WithLabelValues(result).Inc()
	h.metrics.hitTokens.WithLabelValues(d.Model).Add(float64(d.ExternalTokens))
	h.metrics.asked.WithLabelValues(d.Model).Add(float64(max(0, d.NumTokens-d.NumComputedTokens)))
	h.metrics.duration.Observe(elapsed.Seconds())
	hit := 0
	for _, c := range d.Children {
		if c.Name == d.Chosen && c.Spec != nil {
			hit = c.Spec.KVPoolCachedTokens
		}
	}
	span.SetAttributes(
		attribute.Int("kvmesh.hit_tokens", hit),
		attribute.Int("kvmesh.external_tokens", d.ExternalTokens),
		attribute.String("kvmesh.chosen", d.Chosen),
		attribute.Bool("kvmesh.pending", d.Pending),
		attribute.String("kvmesh.decision_id", d.DecisionID),
	)
}

// refuse records a request refused with a 4xx (the response is written).
func (h *Handler) refuse(span trace.Span, field string, err error) {
	h.metrics.requests.WithLabelValues(ResultInvalid).Inc()
	if field != "" {
		span.SetAttributes(attribute.String("kvmesh.invalid_field", field))
	}
	span.AddEvent("invalid request", trace.WithAttributes(attribute.String("error", err.Error())))
}

// fail answers a lookup that could not be decided: 503 with Retry-After
// when the decision could not be published, 500 otherwise.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, span trace.Span, result string, err error) {
	h.metrics.requests.WithLabelValues(result).Inc()
	span.RecordError(err)
	span.SetStatus(codes.Error, result)
	h.opts.Log.WarnContext(r.Context(), "lookup failed", "result", result, "err", err)
	var detail string
	status := http.StatusServiceUnavailable
	switch result {
	case ResultPublishFailed:
		detail = "the decision could not be published to " + contract.TopicLookupDecisions + "; do not act on this lookup, retry later"
	default:
		status, detail = http.StatusInternalServerError, "the lookup failed unexpectedly"
	}
	if status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", strconv.Itoa(RetryAfter))
	}
	httpserver.WriteProblem(w, r, status, "", detail, map[string]any{"result": result})
}

// writeFieldError answers 400 with the problem err describes and the field
// it is about (a FieldError's, or none), and returns that field.
func writeFieldError(w http.ResponseWriter, r *http.Request, err error) string {
	fe := &FieldError{Detail: err.Error()}
	errors.As(err, &fe)
	httpserver.WriteProblem(w, r, http.StatusBadRequest, "", fe.Error(), map[string]any{"field": fe.Field})
	return fe.Field
}
