// Package app is the scheduler service: the engine's scheduler-side
// connector, keeping every request's tracker in PostgreSQL and emitting load
// and save tasks through the transactional outbox.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/deadletter/dlqhttp"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/api"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/intake"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
)

// GroupID is the scheduler's consumer group.
const GroupID = "kvmesh-scheduler"

// MaxConsumers bounds KVMESH_SCHEDULER_CONSUMERS: each member holds a
// database connection while it applies a record, and the pool has
// database.DefaultMaxConns.
const MaxConsumers = 8

// MaxBatchSize bounds KVMESH_SCHEDULER_BATCH.
const MaxBatchSize = 4096

// DefaultBatchLinger is KVMESH_SCHEDULER_BATCH_LINGER's default, and
// MaxBatchLinger its bound.
const (
	DefaultBatchLinger = 2 * time.Millisecond
	MaxBatchLinger     = 100 * time.Millisecond
)

// Config is the scheduler's configuration.
type Config struct {
	service.Common
	// HTTP is the admin and health listen address.
	service.HTTP
	// Database locates PostgreSQL.
	service.Database
	// Migrate applies migrations at start.
	Migrate bool `env:"KVMESH_MIGRATE" doc:"scheduler only: apply database migrations at start"`
	// TrackerRetention is how long finished trackers are kept.
	TrackerRetention time.Duration `env:"KVMESH_TRACKER_RETENTION" doc:"how long trackers of finished requests, processed-record ids and sent outbox rows are kept before the purge deletes them"`
	// TrackerIdleTimeout is how long an unfinished tracker may go without
	// an update before it is purged.
	TrackerIdleTimeout time.Duration `env:"KVMESH_TRACKER_IDLE_TIMEOUT" doc:"unfinished trackers not updated for this long (their engine is gone) are purged"`
	// NoOutboxRelay stops this process from running the outbox relay (the
	// zero value runs it).
	NoOutboxRelay bool `env:"KVMESH_OUTBOX_RELAY_DISABLED" doc:"operator switch: true runs no outbox relay here, so committed tasks stay in the outbox until a scheduler with the relay on publishes them"`
	// PublishOnCommit is the outbox's publish-on-commit switch.
	service.PublishOnCommit
	// Consumers is the number of consumer-group members in this process.
	Consumers int `env:"KVMESH_SCHEDULER_CONSUMERS" doc:"consumer-group members in this process (1-8); more apply records of different partitions in parallel, in smaller transactions: one member batches the most records per transaction and costs the least CPU per record"`
	// BatchSize bounds the records one transaction applies.
	BatchSize int `env:"KVMESH_SCHEDULER_BATCH" doc:"most records (engine steps, lookup decisions, transfer results) one consumer applies in one PostgreSQL transaction (1-4096)"`
	// BatchLinger is how long a batch stays open for more records.
	BatchLinger time.Duration `env:"KVMESH_SCHEDULER_BATCH_LINGER" doc:"how long a consumer keeps a batch open for more records after its first arrived (records already fetched join at once): a longer wait applies more records per PostgreSQL transaction, and adds up to this much to a record's latency (up to 100ms; 0 is the consumer's own 500µs)"`
	// MaintenanceInterval paces the gauges and the purge.
	MaintenanceInterval time.Duration `env:"KVMESH_MAINTENANCE_INTERVAL" doc:"how often the tracker and outbox gauges are refreshed and the retention purge runs"`
	// LoadRankTimeout is how long a multi-rank load waits for every rank's
	// result before it is finished with every block in error.
	LoadRankTimeout time.Duration `env:"KVMESH_LOAD_RANK_TIMEOUT" doc:"how long a load of a multi-rank engine waits for every worker rank's result; then it is finished fail-closed (finished_recving with every block of the load in load_errors and missing_ranks naming the silent ranks). Checked every min(KVMESH_MAINTENANCE_INTERVAL, half of this)"`
	// KVEventsTokenIDs keeps the token ids engines send with admitted
	// events, for the token_ids of the BlockStored KV events (false drops
	// them at intake). Like Migrate, a Config built in code must set it.
	KVEventsTokenIDs bool `env:"KVMESH_KV_EVENTS_TOKEN_IDS" doc:"operator switch: keep the prompt token ids engines send with admitted events (the first 32768, one copy per request in PostgreSQL, 4 bytes a token; and on every save task), so the BlockStored events on kvmesh.kv.events carry the token_ids of their blocks and token-keyed routers (llm-d's KV-cache indexer) can index kvmesh's store. false drops them at intake: nothing token-derived is stored or put on tasks, events carry token_ids [] and only hash-keyed consumers can use them"`
}

// Validate checks the settings.
func (c *Config) Validate() error {
	errs := []error{c.Common.Validate()}
	if c.TrackerRetention <= 0 {
		errs = append(errs, fmt.Errorf("KVMESH_TRACKER_RETENTION: %s is not positive", c.TrackerRetention))
	}
	if c.TrackerIdleTimeout < c.TrackerRetention {
		errs = append(errs, fmt.Errorf("KVMESH_TRACKER_IDLE_TIMEOUT: %s is below the retention %s", c.TrackerIdleTimeout, c.TrackerRetention))
	}
	if c.Consumers < 1 || c.Consumers > MaxConsumers {
		errs = append(errs, fmt.Errorf("KVMESH_SCHEDULER_CONSUMERS: %d is not from 1 to %d", c.Consumers, MaxConsumers))
	}
	if c.BatchSize < 1 || c.BatchSize > MaxBatchSize {
		errs = append(errs, fmt.Errorf("KVMESH_SCHEDULER_BATCH: %d is not from 1 to %d", c.BatchSize, MaxBatchSize))
	}
	if c.BatchLinger < 0 || c.BatchLinger > MaxBatchLinger {
		errs = append(errs, fmt.Errorf("KVMESH_SCHEDULER_BATCH_LINGER: %s is not from 0 to %s", c.BatchLinger, MaxBatchLinger))
	}
	if c.MaintenanceInterval <= 0 {
		errs = append(errs, fmt.Errorf("KVMESH_MAINTENANCE_INTERVAL: %s is not positive", c.MaintenanceInterval))
	}
	if c.LoadRankTimeout <= 0 {
		errs = append(errs, fmt.Errorf("KVMESH_LOAD_RANK_TIMEOUT: %s is not positive", c.LoadRankTimeout))
	}
	return errors.Join(errs...)
}

// SetDefaults gives the scheduler's defaults (config.Defaulter), the
// shared settings' (Common's) set before: the contract's listen address
// and the scheduler's own.
func (c *Config) SetDefaults() {
	c.HTTPAddr = contract.SchedulerAddr
	c.Migrate = true
	c.TrackerRetention = time.Hour
	c.TrackerIdleTimeout = 24 * time.Hour
	c.Consumers = 1
	c.BatchSize = 256
	c.BatchLinger = DefaultBatchLinger
	c.MaintenanceInterval = 15 * time.Second
	c.LoadRankTimeout = 30 * time.Second
	c.KVEventsTokenIDs = true
}

// DefaultConfig returns the scheduler's configuration with every default
// set: what Load starts from.
func DefaultConfig() Config { return config.Defaults[Config]() }

// codeDefaulted are the scheduler's own settings that New gives their
// defaults (from SetDefaults) when they are zero, for a Config built in
// code rather than loaded.
var codeDefaulted = []string{
	"KVMESH_TRACKER_RETENTION", "KVMESH_TRACKER_IDLE_TIMEOUT",
	"KVMESH_SCHEDULER_CONSUMERS", "KVMESH_SCHEDULER_BATCH", "KVMESH_SCHEDULER_BATCH_LINGER", "KVMESH_MAINTENANCE_INTERVAL",
	"KVMESH_LOAD_RANK_TIMEOUT",
}

// App is a wired scheduler, ready to Run.
type App struct {
	cfg     Config
	deps    *service.Deps
	model   *kvcore.Model // the default one
	models  *kvcore.Models
	srv     *httpserver.Server
	relay   *database.Relay
	direct  *database.Direct // nil: the relay publishes everything
	ledger  *ledger.Ledger
	handler *intake.Handler
	// deadLetters keeps the records the consumers give up on.
	deadLetters *deadletter.Store
	consumers   []*bus.Consumer
	gauges      *gauges
}

// New connects to PostgreSQL (applying migrations), Kafka and binds the HTTP
// address, in that order, and builds the consumers.
func New(ctx context.Context, cfg Config, log *slog.Logger) (_ *App, err error) {
	if err := config.FillZero(&cfg, codeDefaulted...); err != nil {
		return nil, fmt.Errorf("scheduler config defaults: %w", err)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	a := &App{cfg: cfg, deps: service.NewDeps(log)}
	defer func() {
		if err != nil {
			a.deps.Close()
		}
	}()
	if a.models, err = cfg.LoadModels(); err != nil {
		return nil, err
	}
	a.model = a.models.Default()
	if err = a.deps.OpenDatabase(ctx, cfg.DatabaseURL, "kvmesh-scheduler", cfg.Migrate); err != nil {
		return nil, err
	}
	if err = a.deps.OpenBus(ctx, &cfg.Common); err != nil {
		return nil, err
	}
	failures, err := database.WithFailureMetric(a.deps.Registry)
	if err != nil {
		return nil, err
	}
	a.relay = database.NewRelay(a.deps.Pool, a.deps.Producer, database.WithLogger(log), failures)
	opts := []ledger.Option{ledger.WithLoadRankTimeout(cfg.LoadRankTimeout), ledger.WithFold(intake.FoldFeedback), ledger.WithModels(a.models)}
	if !cfg.NoOutboxRelay && !cfg.NoPublishOnCommit {
		if a.direct, err = database.NewServiceDirect(a.deps.Pool, a.deps.Producer, a.relay, a.deps.Registry, log); err != nil {
			return nil, err
		}
		opts = append(opts, ledger.WithDirect(a.direct))
	}
	a.ledger = ledger.New(a.deps.Pool, a.model, opts...)
	if err = a.buildConsumers(); err != nil {
		return nil, err
	}
	if a.gauges, err = newGauges(a.deps.Registry); err != nil {
		return nil, err
	}
	if a.srv, err = a.deps.HTTPServer(cfg.HTTPAddr, "scheduler", &cfg.Common); err != nil {
		return nil, err
	}
	api.New(a.ledger, a.models, a.relay, log).Mount(a.srv.Router(), a.srv.RequireAdmin())
	replay := deadletter.NewHandlerReplayer(a.deadLetters, bus.BatchHandler(a.handler.HandleBatch).Single())
	dlqhttp.New(a.deadLetters, replay, log).Mount(a.srv.Router(), a.srv.RequireAdmin(), a.srv.RequireAdmin())
	a.srv.Router().Get(service.ModelsRoute, service.ModelsHandler(a.models))
	a.srv.ServeOpenAPI(OpenAPI)
	return a, nil
}

// buildConsumers creates the consumer-group members over the three topics,
// each applying up to BatchSize records per transaction.
func (a *App) buildConsumers() error {
	metrics, err := intake.NewMetrics(a.deps.Registry)
	if err != nil {
		return err
	}
	h := intake.NewHandler(a.ledger, a.models, metrics, a.deps.Log, intake.Options{DropTokenIDs: !a.cfg.KVEventsTokenIDs})
	a.handler = h
	cc := a.cfg.ConsumerConfig(GroupID, intake.Topics, a.deps.Log)
	// A record given up on is kept in the shared dead_letters table
	// (pkg/deadletter) and counted.
	a.deadLetters = deadletter.NewStore(a.deps.Pool, deadletter.ServiceScheduler)
	cc.OnDeadLetter = a.deadLetters.Record(func(_ context.Context, d deadletter.DeadLetter, _ error) {
		metrics.DeadLettered(d.Topic, d.Reason)
	})
	// A database outage must not dead-letter records: retry until it ends.
	// Data PostgreSQL rejects fails a batch permanently instead: its
	// records are then applied one at a time and the one at fault is
	// dead-lettered (kvcore.ReasonDatabaseRejected).
	cc.Retry = retry.Policy{MaxAttempts: math.MaxInt, Backoff: retry.Backoff{Max: bus.DefaultMaxBackoff}}
	cc.BatchSize = a.cfg.BatchSize
	cc.BatchLinger = a.cfg.BatchLinger
	if err := a.deps.WatchConsumerLag(cc); err != nil {
		return err
	}
	for range a.cfg.Consumers {
		c, err := bus.NewBatchConsumer(cc, h.HandleBatch)
		if err != nil {
			return err
		}
		a.consumers = append(a.consumers, c)
	}
	return nil
}

// Addr is the bound HTTP address.
func (a *App) Addr() string { return a.srv.Addr() }

// Run serves until ctx is cancelled, then releases every connection.
func (a *App) Run(ctx context.Context) error {
	defer a.deps.Close()
	tasks := []service.Task{
		{Name: "http", Run: a.srv.Run},
		{Name: "maintenance", Run: a.maintain},
	}
	if a.cfg.NoOutboxRelay {
		a.deps.Log.Warn("outbox relay disabled (KVMESH_OUTBOX_RELAY_DISABLED): committed tasks stay in the outbox")
	} else {
		tasks = append(tasks, service.Task{Name: "outbox-relay", Run: a.relay.Run})
	}
	if a.direct != nil {
		tasks = append(tasks, service.Task{Name: "outbox-direct", Run: a.direct.Run})
	}
	for i, c := range a.consumers {
		tasks = append(tasks, service.Task{Name: "consumer-" + strconv.Itoa(i), Run: c.Run})
	}
	return service.Run(ctx, a.deps.Log, tasks...)
}
