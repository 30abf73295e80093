// Package app is the lookup service: the engine's get_num_new_matched_tokens: it finds the prefix of a request that the store pool holds and runs the MultiConnector chain.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/lookup/internal/api"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
	"github.com/kvmesh/kvmesh/services/lookup/internal/engines"
	"github.com/kvmesh/kvmesh/services/lookup/internal/kvpublish"
)

// StoreOp is the op label of the lookup's existence checks in the store
// metrics (kvmesh_store_op_duration_seconds and friends).
const StoreOp = "lookup_exists"

// Config is the lookup's configuration.
type Config struct {
	service.Common
	// HTTP is the API and health listen address.
	service.HTTP
	// Store locates the store pool, with its TLS settings.
	service.Store
	service.Tier
	// Enabled turns lookups on; disabled, every lookup is answered 0.
	Enabled bool `env:"KVMESH_LOOKUP_ENABLED" doc:"answer lookups from the connector chain; false answers every lookup with 0 tokens and no LoadSpec"`
	// Connectors is the MultiConnector chain, in order.
	Connectors []string `env:"KVMESH_LOOKUP_CONNECTORS" doc:"connector chain, in order, comma-separated: store, pd (e.g. pd,store); the first child with a positive count is chosen"`
	// LoadAsync is the default load_async of a positive answer.
	LoadAsync bool `env:"KVMESH_LOAD_ASYNC" doc:"load external tokens asynchronously unless a lookup says otherwise"`
	// Timeout bounds one lookup's store check and decision publish.
	Timeout time.Duration `env:"KVMESH_LOOKUP_TIMEOUT" doc:"bound on one lookup's store check, and on its own on the decision publish; a store check past it fails open (the store child answers 0), a publish past it answers 503"`
	// MaxBodyBytes limits a lookup request body.
	MaxBodyBytes int64 `env:"KVMESH_LOOKUP_MAX_BODY_BYTES" doc:"largest POST /v1/lookup body in bytes (a 32K-token token_ids list is about 250 KB)"`
	// EngineScores has POST /v1/score score the engines' own prefix caches.
	EngineScores bool `env:"KVMESH_LOOKUP_ENGINE_SCORES" doc:"have POST /v1/score also score each engine's own prefix cache, from the vLLM KV events engines publish to kvmesh.kv.events (header kvmesh-engine-id); every lookup replica reads the whole topic from its oldest retained record into memory"`
	// KVEventsZMQEndpoint turns the ZMQ publisher of kvmesh.kv.events on.
	KVEventsZMQEndpoint string `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT" doc:"bind address of a ZMQ PUB socket that republishes kvmesh.kv.events exactly as a vLLM pod publishes its KV events (e.g. tcp://*:5557), for a KV-aware router such as llm-d's to index the store as one more pod; empty turns the publisher off"`
	// KVEventsZMQReplayEndpoint is the publisher's ROUTER replay socket.
	KVEventsZMQReplayEndpoint string `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_ENDPOINT" doc:"bind address of the publisher's ROUTER socket answering vLLM replay requests (8-byte big-endian start seq) from its buffer (e.g. tcp://*:5558); empty for none"`
	// KVEventsZMQBufferSteps is the batches kept for replay.
	KVEventsZMQBufferSteps int `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_BUFFER_STEPS" doc:"published batches the publisher keeps for replay (vLLM's buffer_steps); 0 is the default"`
	// KVEventsZMQPod is the pod identifier of the publisher's topic.
	KVEventsZMQPod string `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_POD" doc:"pod identifier in the publisher's topic kv@<pod>@<model>: the name the router scores the store under; give each tenant's publisher its own"`
	// KVEventsZMQModel is the model name of the publisher's topic.
	KVEventsZMQModel string `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_MODEL" doc:"model name in the publisher's topic kv@<pod>@<model>, the name the router scores requests under (vLLM's served model name); empty for the deployment's model name (KVMESH_MODEL's name)"`
	// KVEventsZMQTenant is the one tenant key space published.
	KVEventsZMQTenant string `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_TENANT" doc:"the one tenant whose key space the publisher publishes; empty for the tenant-less key space. Events carry prompt token ids, so one endpoint never mixes tenants: run one publisher (lookup replica) per tenant key space"`
	// KVEventsZMQForm is the wire form of the published events.
	KVEventsZMQForm contract.KVEventForm `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM" doc:"wire form of the published events: map (vLLM's events since vllm-project/vllm#42892) or array (vLLM's older positional events, the only form llm-d-kv-cache up to v0.8.1 decodes)"`
	// KVEventsZMQClearAsRemoved follows an AllBlocksCleared with the
	// removal of every block the publisher announced.
	KVEventsZMQClearAsRemoved bool `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_CLEAR_AS_REMOVED" doc:"follow each AllBlocksCleared with BlockRemoved events of every block hash announced stored and not removed since the publisher started, for routers that ignore AllBlocksCleared (llm-d-kv-cache v0.8.1 only logs it), from the set of live hashes the publisher keeps anyway (about 40 bytes a block) to order parents before children"`
	// KVEventsZMQReplayFraming is the framing of replay replies.
	KVEventsZMQReplayFraming kvpublish.ReplayFraming `env:"KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_FRAMING" doc:"framing of replay replies: topic ([id, \"\", topic, seq, payload], end [id, \"\", \"\", -1, \"\"], current vLLM) or seq ([id, \"\", seq, payload], end [id, \"\", -1, \"\"], vLLM before it added the topic frame)"`
}

// SetDefaults gives the lookup's defaults (config.Defaulter), the shared
// settings' (Common's) set before: the contract's listen address, the
// connector package's default chain, the handler's limits and the ZMQ
// publisher's settings.
func (c *Config) SetDefaults() {
	c.HTTPAddr = contract.LookupAddr
	c.Enabled = true
	c.Connectors = connector.DefaultChain()
	c.LoadAsync = true
	c.Timeout = api.DefaultTimeout
	c.MaxBodyBytes = api.DefaultMaxBodyBytes
	c.KVEventsZMQBufferSteps = 10000
	c.KVEventsZMQPod = "kvmesh-store"
	c.KVEventsZMQForm = contract.KVEventFormMap
	c.KVEventsZMQClearAsRemoved = true
	c.KVEventsZMQReplayFraming = kvpublish.FramingTopic
}

// DefaultConfig returns the lookup's configuration with every default set:
// what Load starts from.
func DefaultConfig() Config { return config.Defaults[Config]() }

// Validate checks the shared and the lookup settings.
func (c *Config) Validate() error {
	return errors.Join(c.Common.Validate(), c.validateLookup())
}

// validateLookup checks the lookup's own settings (zero durations and
// sizes are allowed: New applies the defaults).
func (c *Config) validateLookup() error {
	var errs []error
	if len(c.Connectors) > 0 {
		if err := connector.CheckNames(c.Connectors); err != nil {
			errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_CONNECTORS: %w", err))
		}
	}
	if c.Timeout < 0 {
		errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_TIMEOUT: %s is negative", c.Timeout))
	}
	if c.MaxBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_MAX_BODY_BYTES: %d is negative", c.MaxBodyBytes))
	}
	return errors.Join(append(errs, c.validateKVEventsZMQ())...)
}

// validateKVEventsZMQ checks the ZMQ publisher's settings.
func (c *Config) validateKVEventsZMQ() error {
	var errs []error
	if c.KVEventsZMQReplayEndpoint != "" && c.KVEventsZMQEndpoint == "" {
		errs = append(errs, errors.New("KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_ENDPOINT: set without KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT"))
	}
	if c.KVEventsZMQBufferSteps < 0 {
		errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_KV_EVENTS_ZMQ_BUFFER_STEPS: %d is negative", c.KVEventsZMQBufferSteps))
	}
	if err := kvcore.ValidateTenant(c.KVEventsZMQTenant); err != nil {
		errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_KV_EVENTS_ZMQ_TENANT: %w", err))
	}
	if err := c.KVEventsZMQForm.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM: %w", err))
	}
	if err := c.KVEventsZMQReplayFraming.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_FRAMING: %w", err))
	}
	return errors.Join(errs...)
}

// App is a wired lookup, ready to Run.
type App struct {
	deps   *service.Deps
	model  *kvcore.Model // the default one
	models *kvcore.Models
	srv    *httpserver.Server
	// kvEvents reads kvmesh.kv.events into the engine index
	// (KVMESH_LOOKUP_ENGINE_SCORES) and the ZMQ publisher; nil when both
	// are off.
	kvEvents *bus.Consumer
	kvpub    *kvpublish.Publisher // nil unless KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT is set
}

// New opens the service's connections and binds the HTTP address, in a
// fixed order.
func New(ctx context.Context, cfg Config, log *slog.Logger) (_ *App, err error) {
	if err := cfg.validateLookup(); err != nil {
		return nil, err
	}
	a := &App{deps: service.NewDeps(log)}
	defer func() {
		if err != nil {
			a.deps.Close()
			if a.kvpub != nil {
				a.kvpub.Close()
			}
		}
	}()
	if a.models, err = cfg.LoadModels(); err != nil {
		return nil, err
	}
	a.model = a.models.Default()
	// The store's readiness check is optional: the store child fails open
	// (a store outage answers 0 external tokens, and a pd hit still wins),
	// so the lookup stays ready while the store is down — taking it out of
	// the engines' routing would fail every lookup, pd hits included.
	// /readyz still names the store (checks.store failed, "store" in
	// degraded), as do kvmesh_lookup_child_failures_total and
	// kvmesh_store_failed_keys_total{op="lookup_exists"}. The broker check
	// stays required: a decision that cannot be published is a 503.
	if err = a.deps.OpenOptionalStore(ctx, cfg.Store); err != nil {
		return nil, err
	}
	if err = a.deps.OpenTier(ctx, cfg.Tier); err != nil {
		return nil, err
	}
	// The lookup publishes only decisions, each on the engine's critical
	// path: its producer sends every record at once (api.DecisionProducerOptions).
	if err = a.deps.OpenBus(ctx, &cfg.Common, api.DecisionProducerOptions()...); err != nil {
		return nil, err
	}
	var idx *engines.Index
	if cfg.EngineScores {
		idx = engines.NewIndex(len(a.model.Groups))
	}
	h, sh, err := a.handler(cfg, idx)
	if err != nil {
		return nil, err
	}
	if a.kvpub, err = a.newKVPublisher(cfg); err != nil {
		return nil, err
	}
	if a.kvEvents, err = a.kvEventsConsumer(cfg, idx, a.kvpub); err != nil {
		return nil, err
	}
	if a.srv, err = a.deps.HTTPServer(cfg.HTTPAddr, "lookup", &cfg.Common); err != nil {
		return nil, err
	}
	h.Mount(a.srv.Router())
	sh.Mount(a.srv.Router())
	a.srv.Router().Get(service.ModelsRoute, service.ModelsHandler(a.models))
	a.srv.ServeOpenAPI(OpenAPI)
	return a, nil
}

// handler builds a connector chain per served model over the
// instrumented store, the lookup API and the score API (over the same
// store, under its own op).
func (a *App) handler(cfg Config, idx *engines.Index) (*api.Handler, *api.ScoreHandler, error) {
	sm, err := kvstore.NewMetrics(a.deps.Registry)
	if err != nil {
		return nil, nil, err
	}
	names := cfg.Connectors
	if len(names) == 0 {
		names = connector.DefaultChain()
	}
	var served []api.Served
	var scored []api.ScoreModel
	for _, m := range a.models.All() {
		kb, err := a.models.Keys(m.Name)
		if err != nil {
			return nil, nil, err
		}
		chain, err := connector.Build(names, connector.Deps{
			Model: m,
			Keys:  kb,
			// The engine of each call comes with its query (connector.Store).
			Store: kvstore.Instrument(a.deps.Blocks, sm, kvstore.OpNames{Exists: StoreOp}).WithLabels(kvstore.VLLMLabels{ModelName: m.Name}),
		})
		if err != nil {
			return nil, nil, err
		}
		served, scored = append(served, api.Served{Model: m, Chain: chain}), append(scored, api.ScoreModel{Model: m, Keys: kb})
	}
	common := api.Common{Timeout: cfg.Timeout, MaxBodyBytes: cfg.MaxBodyBytes, Registry: a.deps.Registry, Log: a.deps.Log}
	h, err := api.New(api.Options{
		Model:     served[0].Model,
		Chain:     served[0].Chain,
		More:      served[1:],
		Publisher: a.deps.Producer,
		Enabled:   cfg.Enabled,
		LoadAsync: cfg.LoadAsync,
		Common:    common,
	})
	if err != nil {
		return nil, nil, err
	}
	sh, err := a.scoreHandler(common, scored, sm, idx)
	return h, sh, err
}

// newKVPublisher binds the ZMQ publisher of kvmesh.kv.events, or returns
// nil when KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT is empty. Its metrics are
// served either way (at 0 when it is off), as the dashboards query them.
func (a *App) newKVPublisher(cfg Config) (*kvpublish.Publisher, error) {
	m, err := kvpublish.NewMetrics(a.deps.Registry)
	if err != nil || cfg.KVEventsZMQEndpoint == "" {
		return nil, err
	}
	kb, err := a.models.Keys(a.model.Name)
	if err != nil {
		return nil, err
	}
	return kvpublish.New(kvpublish.Options{
		Keys: kb, Tenant: cfg.KVEventsZMQTenant,
		Model: cfg.KVEventsZMQModel, Pod: cfg.KVEventsZMQPod, Form: cfg.KVEventsZMQForm,
		Endpoint: cfg.KVEventsZMQEndpoint, ReplayEndpoint: cfg.KVEventsZMQReplayEndpoint,
		ReplayFraming: cfg.KVEventsZMQReplayFraming, BufferSteps: cfg.KVEventsZMQBufferSteps,
		ClearAsRemoved: cfg.KVEventsZMQClearAsRemoved, Metrics: m, Logger: a.deps.Log,
	})
}

// Addr is the bound HTTP address.
func (a *App) Addr() string { return a.srv.Addr() }

// KVEventsZMQAddr is the ZMQ publisher's bound PUB address; "" when it is
// off.
func (a *App) KVEventsZMQAddr() string {
	if a.kvpub == nil {
		return ""
	}
	return a.kvpub.Addr()
}

// KVEventsZMQReplayAddr is the ZMQ publisher's bound ROUTER replay
// address; "" when it is off or has none.
func (a *App) KVEventsZMQReplayAddr() string {
	if a.kvpub == nil {
		return ""
	}
	return a.kvpub.ReplayAddr()
}

// Run serves until ctx is cancelled, then releases every connection.
func (a *App) Run(ctx context.Context) error {
	defer a.deps.Close()
	tasks := []service.Task{{Name: "http", Run: a.srv.Run}}
	if a.kvEvents != nil {
		tasks = append(tasks, service.Task{Name: "kv-events", Run: a.kvEvents.Run})
	}
	if a.kvpub != nil {
		tasks = append(tasks, service.Task{Name: "kv-events-zmq", Run: a.kvpub.Run})
	}
	return service.Run(ctx, a.deps.Log, tasks...)
}
