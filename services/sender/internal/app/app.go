// Package app is the sender service: the sending thread as a service: it validates save tasks per group, moves only missing blocks through the owning gpuworker, and dead-letters what it cannot save.
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
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/sender/internal/api"
	"github.com/kvmesh/kvmesh/services/sender/internal/evictions"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/quotas"
	"github.com/kvmesh/kvmesh/services/sender/internal/removals"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// ConsumerGroup is the sender's Kafka consumer group on kvmesh.save.tasks.
const ConsumerGroup = "kvmesh-sender"

// Config is the sender's configuration.
type Config struct {
	service.Common
	// HTTP is the API and health listen address.
	service.HTTP
	// Database locates PostgreSQL.
	service.Database
	// Store locates the store pool, where the sender checks which keys
	// exist, with its TLS settings.
	service.Store
	// Consumers is the number of consumer-group members in this process.
	Consumers int `env:"KVMESH_SENDER_CONSUMERS" doc:"consumer-group members in this process (each handles up to KVMESH_SENDER_CONCURRENCY tasks of its partitions at once)"`
	// Concurrency is the save tasks each consumer handles at once.
	Concurrency int `env:"KVMESH_SENDER_CONCURRENCY" doc:"save tasks each consumer-group member handles at once, in lanes by request id: the tasks of one request are handled in order, one at a time"`
	// RetryAttempts bounds the attempts of an existence check or a put.
	RetryAttempts int `env:"KVMESH_SENDER_RETRY_ATTEMPTS" doc:"attempts (the first included) of an existence check or put before the group is dead-lettered"`
	// RetryBase is the first retry's delay.
	RetryBase time.Duration `env:"KVMESH_SENDER_RETRY_BASE" doc:"delay before the first retry; doubles per retry"`
	// RetryMax caps the retry delay.
	RetryMax time.Duration `env:"KVMESH_SENDER_RETRY_MAX" doc:"longest delay between retries"`
	// ProbeEvery is the skips between probes of a request under pressure.
	ProbeEvery int `env:"KVMESH_SENDER_PROBE_EVERY" doc:"for a request under store pressure (its put got \"no space\"), let one of its tasks through as a probe after this many of its skipped tasks"`
	// PressureCoolDown is the longest wait between probes.
	PressureCoolDown time.Duration `env:"KVMESH_SENDER_PRESSURE_COOLDOWN" doc:"for a request under store pressure, let a probe through at least this often"`
	// Workers is how old a gpuworker heartbeat may be.
	service.Workers
	// StoreTimeout bounds one existence check.
	StoreTimeout time.Duration `env:"KVMESH_SENDER_STORE_TIMEOUT" doc:"time limit of one batched existence check"`
	// PutTimeout bounds one put request to a gpuworker.
	PutTimeout time.Duration `env:"KVMESH_SENDER_PUT_TIMEOUT" doc:"time limit of one put request to a gpuworker"`
	// Evictions turns on the store-removal watcher (package evictions).
	Evictions bool `env:"KVMESH_SENDER_EVICTIONS" doc:"publish BlockRemoved to kvmesh.kv.events for every store key Redis evicts, expires or deletes, observed through keyspace notifications (one sender replica per deployment watches, elected through a PostgreSQL advisory lock); false turns the watcher off"`
	// EvictionsConfigure lets the watcher set notify-keyspace-events.
	EvictionsConfigure bool `env:"KVMESH_SENDER_EVICTIONS_CONFIGURE" doc:"let the removal watcher add the flags it needs (Egxe) to Redis's notify-keyspace-events with CONFIG SET; false only checks them (a server that refuses CONFIG is then trusted to have them) and the sender refuses to start when they are missing"`
	// KVEvents is the wire form of the events on kvmesh.kv.events, shared
	// with the gpuworkers.
	service.KVEvents
	// RenamedKVEventsForm is the setting's former name, refused.
	RenamedKVEventsForm string `env:"KVMESH_SENDER_KV_EVENTS_FORM" doc:"renamed KVMESH_KV_EVENTS_FORM (the gpuworkers' capacity-tier events share it); the sender refuses to start while this is set"`
	// PublishOnCommit is the outbox's publish-on-commit switch.
	service.PublishOnCommit
}

// SetDefaults gives the sender's defaults (config.Defaulter), the shared
// settings' (Common's, Workers') set before: the contract's listen
// address, kvcore's retry and store-pressure policies, the processor's
// time limits and the sender's own.
func (c *Config) SetDefaults() {
	c.HTTPAddr = contract.SenderAddr
	c.Consumers = 1
	c.Concurrency = 16
	c.RetryAttempts = sendpolicy.DefaultRetryAttempts
	c.RetryBase = sendpolicy.DefaultRetryBase
	c.RetryMax = sendpolicy.DefaultRetryMax
	c.ProbeEvery = sendpolicy.DefaultProbeEvery
	c.PressureCoolDown = sendpolicy.DefaultPressureCoolDown
	c.StoreTimeout = sending.DefaultStoreTimeout
	c.PutTimeout = sending.DefaultPutTimeout
	c.Evictions = true
	c.EvictionsConfigure = true
}

// DefaultConfig returns the sender's configuration with every default set:
// what Load starts from.
func DefaultConfig() Config { return config.Defaults[Config]() }

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if err := c.Common.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.Consumers < 1 {
		errs = append(errs, fmt.Errorf("KVMESH_SENDER_CONSUMERS: %d is not positive", c.Consumers))
	}
	if c.Concurrency < 1 {
		errs = append(errs, fmt.Errorf("KVMESH_SENDER_CONCURRENCY: %d is not positive", c.Concurrency))
	}
	if err := c.KVEvents.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.RenamedKVEventsForm != "" {
		errs = append(errs, fmt.Errorf("KVMESH_SENDER_KV_EVENTS_FORM=%q: %w to KVMESH_KV_EVENTS_FORM", c.RenamedKVEventsForm, config.ErrRenamed))
	}
	if c.RetryAttempts < 1 {
		errs = append(errs, fmt.Errorf("KVMESH_SENDER_RETRY_ATTEMPTS: %d is not positive", c.RetryAttempts))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"KVMESH_SENDER_RETRY_BASE", c.RetryBase},
		{"KVMESH_SENDER_RETRY_MAX", c.RetryMax}, {"KVMESH_SENDER_PRESSURE_COOLDOWN", c.PressureCoolDown},
		{"KVMESH_WORKER_STALE_AFTER", c.WorkerStaleAfter}, {"KVMESH_SENDER_STORE_TIMEOUT", c.StoreTimeout},
		{"KVMESH_SENDER_PUT_TIMEOUT", c.PutTimeout},
	} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s: %s is not positive", d.name, d.v))
		}
	}
	return errors.Join(errs...)
}

// App is a wired sender, ready to Run.
type App struct {
	deps      *service.Deps
	model     *kvcore.Model // the default one
	models    *kvcore.Models
	srv       *httpserver.Server
	processor *sending.Processor
	consumers []*bus.Consumer
	relay     *database.Relay
	direct    *database.Direct // nil: the relay publishes everything
	workers   *sending.Registry
	evictions *evictions.Watcher
	quotas    *quotas.Enforcer // nil: the store keeps no quotas
}

// New opens the service's connections and binds the HTTP address, in a
// fixed order.
func New(ctx context.Context, cfg Config, log *slog.Logger) (_ *App, err error) {
	a := &App{deps: service.NewDeps(log)}
	defer func() {
		if err != nil {
			a.deps.Close()
		}
	}()
	if err = cfg.Validate(); err != nil {
		return nil, err
	}
	if a.models, err = cfg.LoadModels(); err != nil {
		return nil, err
	}
	a.model = a.models.Default()
	if err = a.deps.OpenDatabase(ctx, cfg.DatabaseURL, "kvmesh-sender", false); err != nil {
		return nil, err
	}
	if err = a.deps.OpenStore(ctx, cfg.Store); err != nil {
		return nil, err
	}
	if err = a.deps.OpenBus(ctx, &cfg.Common); err != nil {
		return nil, err
	}
	if a.srv, err = a.deps.HTTPServer(cfg.HTTPAddr, "sender", &cfg.Common); err != nil {
		return nil, err
	}
	if err = a.wire(cfg); err != nil {
		return nil, err
	}
	return a, nil
}

// wire builds the processor, the consumers, the relay and the API.
func (a *App) wire(cfg Config) error {
	kb, err := a.models.Keys(a.model.Name)
	if err != nil {
		return err
	}
	storeMetrics, err := kvstore.NewMetrics(a.deps.Registry)
	if err != nil {
		return err
	}
	metrics, err := sending.NewMetrics(a.deps.Registry)
	if err != nil {
		return err
	}
	failures, err := database.WithFailureMetric(a.deps.Registry)
	if err != nil {
		return err
	}
	a.relay = database.NewRelay(a.deps.Pool, a.deps.Producer, database.WithLogger(a.deps.Log), failures)
	var opts []ledger.Option
	if !cfg.NoPublishOnCommit {
		if a.direct, err = database.NewServiceDirect(a.deps.Pool, a.deps.Producer, a.relay, a.deps.Registry, a.deps.Log); err != nil {
			return err
		}
		opts = append(opts, ledger.WithDirect(a.direct))
	}
	l := ledger.New(a.deps.Pool, opts...)
	rt, err := cfg.ServiceTransport("sender", dataplane.DefaultTransport())
	if err != nil {
		return err
	}
	a.workers = sending.NewRegistry(a.deps.Pool, cfg.WorkerStaleAfter, dataplane.HTTPClient(rt))
	if a.quotas, err = a.newQuotas(); err != nil {
		return err
	}
	a.processor, err = sending.New(sending.Options{
		Model: a.model, Keys: kb, Models: a.models, Ledger: l, Metrics: metrics, Logger: a.deps.Log,
		Store: kvstore.Instrument(a.deps.Store, storeMetrics, kvstore.OpNames{Exists: "save_exists"}).
			WithLabels(kvstore.VLLMLabels{ModelName: a.model.Name}), // the engine comes with each task

		Workers: a.workers, Quotas: a.admitter(),
		Retry:      sendpolicy.RetryPolicy{MaxAttempts: cfg.RetryAttempts, BaseDelay: cfg.RetryBase, MaxDelay: cfg.RetryMax},
		ProbeEvery: cfg.ProbeEvery, CoolDown: cfg.PressureCoolDown,
		StoreTimeout: cfg.StoreTimeout, PutTimeout: cfg.PutTimeout, KVEventsForm: cfg.KVEventsForm,
	})
	if err != nil {
		return err
	}
	cc := cfg.ConsumerConfig(ConsumerGroup, []string{contract.TopicSaveTasks}, a.deps.Log)
	cc.OnDeadLetter = a.processor.DeadLetter
	cc.Concurrency = cfg.Concurrency
	if err := a.deps.WatchConsumerLag(cc); err != nil {
		return err
	}
	for range cfg.Consumers {
		c, err := bus.NewConsumer(cc, a.processor.Handle)
		if err != nil {
			return err
		}
		a.consumers = append(a.consumers, c)
	}
	removed := removals.New(a.deps.Pool, removals.DefaultRetention)
	if a.evictions, err = a.newEvictions(cfg, kb, removed); err != nil {
		return err
	}
	api.New(a.processor, l, registry.NewView(a.deps.Pool, cfg.WorkerStaleAfter), a.deps.Log).WithRemovals(removed).
		WithQuotas(a.quotas).Mount(a.srv.Router(), a.srv.RequireAdmin())
	a.srv.Router().Get(service.ModelsRoute, service.ModelsHandler(a.models))
	a.srv.ServeOpenAPI(OpenAPI)
	return nil
}

// Addr is the bound HTTP address.
func (a *App) Addr() string { return a.srv.Addr() }

// Run serves until ctx is cancelled, then releases every connection.
func (a *App) Run(ctx context.Context) error {
	defer a.deps.Close()
	defer a.workers.Close()
	tasks := []service.Task{
		{Name: "http", Run: a.srv.Run},
		{Name: "outbox-relay", Run: a.relay.Run},
	}
	if a.direct != nil {
		tasks = append(tasks, service.Task{Name: "outbox-direct", Run: a.direct.Run})
	}
	for i, c := range a.consumers {
		tasks = append(tasks, service.Task{Name: fmt.Sprintf("consumer-%d", i), Run: c.Run})
	}
	if a.evictions != nil {
		tasks = append(tasks, service.Task{Name: "evictions", Run: a.evictions.Run})
	}
	if a.quotas != nil {
		tasks = append(tasks, service.Task{Name: "quotas", Run: a.quotas.Run})
	}
	return service.Run(ctx, a.deps.Log, tasks...)
}

// newQuotas builds the tenant quotas' enforcer over the store pool, or nil
// when the store is not one that keeps store times (a Redis store is).
func (a *App) newQuotas() (*quotas.Enforcer, error) {
	store, ok := a.deps.Store.(kvstore.Quotas)
	times, _ := a.deps.Store.(kvstore.StoreTimes)
	if !ok {
		return nil, nil
	}
	m, err := quotas.NewMetrics(a.deps.Registry)
	if err != nil {
		return nil, err
	}
	return quotas.New(quotas.Options{Table: quotas.NewTable(a.deps.Pool), Store: store, StoreTimes: times,
		Spaces: quotas.SpacesOf(a.models, dataplane.ValueOverhead), Metrics: m, Logger: a.deps.Log})
}

// admitter is the processor's quota side: none without an enforcer (a
// nil *quotas.Enforcer is not a nil interface).
func (a *App) admitter() sending.Quotas {
	if a.quotas == nil {
		return nil
	}
	return a.quotas
}

// newEvictions builds the store-removal watcher, or nil when
// KVMESH_SENDER_EVICTIONS is off.
func (a *App) newEvictions(cfg Config, kb kvcore.KeyBuilder, log *removals.Log) (*evictions.Watcher, error) {
	if !cfg.Evictions {
		return nil, nil
	}
	m, err := evictions.NewMetrics(a.deps.Registry)
	if err != nil {
		return nil, err
	}
	times, _ := a.deps.Store.(kvstore.StoreTimes) // the gpuworkers record into the same store
	marks, _ := a.deps.Store.(kvstore.Quotas)     // and the quotas mark their removals in it
	return evictions.New(evictions.Options{
		RedisURL: cfg.RedisURL, RedisTLS: cfg.RedisTLS, Keys: kb, Models: a.models, Publisher: a.deps.Producer, Metrics: m,
		Configure: cfg.EvictionsConfigure, Leader: evictions.NewPGLeader(a.deps.Pool, kb), Logger: a.deps.Log,
		Form: cfg.KVEventsForm, Times: times, Log: log, Quotas: marks,
	})
}
