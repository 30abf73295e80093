// Package app is the gpuworker service: one engine rank's paged KV pool, moving block bytes between it and the store pool.
package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/dataplaneapi"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/load"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/tierevents"
)

// errNotRegistered is the readiness answer until the worker registry holds
// this worker.
var errNotRegistered = errors.New("not registered in the worker registry yet")

// Config is the gpuworker's configuration.
type Config struct {
	service.Common
	// HTTP is the API, health and data-plane listen address.
	service.HTTP
	// Database locates PostgreSQL.
	service.Database
	// Store locates the store pool, with its TLS settings.
	service.Store
	service.Tier
	// KVEvents is the form of the capacity tier's BlockStored records,
	// the sender's.
	service.KVEvents
	// EngineID is the engine whose pool this worker holds.
	EngineID string `env:"KVMESH_ENGINE_ID" required:"true" doc:"engine id whose KV pool this worker holds (one process per engine id and rank)"`
	// RankTP, RankPCP, RankDCP and RankPP are the worker's rank in the engine.
	RankTP  int `env:"KVMESH_RANK_TP" doc:"tensor-parallel rank of this worker"`
	RankPCP int `env:"KVMESH_RANK_PCP" doc:"prefill context-parallel rank of this worker"`
	RankDCP int `env:"KVMESH_RANK_DCP" doc:"decode context-parallel rank of this worker"`
	RankPP  int `env:"KVMESH_RANK_PP" doc:"pipeline-parallel rank of this worker"`
	// PoolBlocks is the number of blocks per KV group.
	PoolBlocks int `env:"KVMESH_POOL_BLOCKS" doc:"blocks per KV group; the pool takes blocks × bytes_per_block per group (hybrid-mla-linear: 1024 × (72 KiB + 256 KiB) = 328 MiB; dense: 1024 × 2 MiB = 2 GiB), committed only as blocks are written"`
	// DataplaneURL is the base URL others reach this worker's data plane at.
	DataplaneURL string `env:"KVMESH_DATAPLANE_URL" doc:"base URL the sender and other workers use to reach this worker's data plane; default http://<bound address> (https:// when KVMESH_HTTP_TLS_CERT_FILE is set), with 127.0.0.1 for a wildcard host (set it on multi-host deployments)"`
	// MaxBatchBytes bounds the value bytes one store Get or Put moves.
	MaxBatchBytes int `env:"KVMESH_MAX_BATCH_BYTES" doc:"largest batch of value bytes one store Get or Put (or pd read) moves at once; bounds the worker's transfer buffers"`
	// StoreStreams is how many put sub-batches (over all puts) or sub-batches of one load are in flight at once.
	StoreStreams int `env:"KVMESH_STORE_STREAMS" doc:"sub-batches in flight at once, each its own store call on its own connection, so framing or verifying one overlaps the transfer of others: for puts over all the worker's puts together (they share this many framing buffers of KVMESH_STREAM_CHUNK_BYTES), for loads per load task (pd reads likewise); raise it for a store of many shards"`
	// StreamChunkBytes bounds the value bytes of one sub-batch.
	StreamChunkBytes int `env:"KVMESH_STREAM_CHUNK_BYTES" doc:"value bytes of one put or load sub-batch (at most KVMESH_MAX_BATCH_BYTES; a larger block goes alone): smaller starts the first transfer sooner, larger costs fewer round trips"`
	// LoadMaxAge bounds how old a load task may be when it is consumed.
	LoadMaxAge time.Duration `env:"KVMESH_LOAD_MAX_AGE" doc:"oldest load task the worker still loads (older: every block reported as a load error, nothing written; its blocks may have been reused since); 0 loads every task"`
	// HeartbeatInterval is how often the worker heartbeats in the registry.
	HeartbeatInterval time.Duration `env:"KVMESH_HEARTBEAT_INTERVAL" doc:"how often the worker refreshes its registration in PostgreSQL"`
	// Workers is how old a heartbeat may be for a pd source worker.
	service.Workers
}

// SetDefaults gives the gpuworker's defaults (config.Defaulter), the
// shared settings' (Common's, Workers') set before: the contract's listen
// address and the worker's own (its ranks default to 0).
func (c *Config) SetDefaults() {
	c.HTTPAddr = contract.GPUWorkerAddr
	c.PoolBlocks = 1024
	c.MaxBatchBytes = 64 << 20
	c.StoreStreams = 4
	c.StreamChunkBytes = 4 << 20
	c.LoadMaxAge = 60 * time.Second
	c.HeartbeatInterval = 5 * time.Second
}

// DefaultConfig returns the gpuworker's configuration with every default
// set: what Load starts from.
func DefaultConfig() Config { return config.Defaults[Config]() }

// Validate checks the configuration.
func (c *Config) Validate() error {
	errs := []error{c.Common.Validate(), c.KVEvents.Validate()}
	if strings.TrimSpace(c.EngineID) == "" {
		errs = append(errs, errors.New("KVMESH_ENGINE_ID: required"))
	}
	if c.RankTP < 0 || c.RankPCP < 0 || c.RankDCP < 0 || c.RankPP < 0 {
		errs = append(errs, errors.New("KVMESH_RANK_*: ranks must not be negative"))
	}
	if c.PoolBlocks < 1 {
		errs = append(errs, fmt.Errorf("KVMESH_POOL_BLOCKS: %d is not positive", c.PoolBlocks))
	}
	if c.MaxBatchBytes < 1<<20 {
		errs = append(errs, fmt.Errorf("KVMESH_MAX_BATCH_BYTES: %d is below 1 MiB", c.MaxBatchBytes))
	}
	// Zero streams or chunk bytes (a Config built in code) take the defaults.
	if c.StoreStreams < 0 || c.StoreStreams > 64 {
		errs = append(errs, fmt.Errorf("KVMESH_STORE_STREAMS: %d is not in 1..64", c.StoreStreams))
	}
	if c.StreamChunkBytes != 0 && c.StreamChunkBytes < 64<<10 {
		errs = append(errs, fmt.Errorf("KVMESH_STREAM_CHUNK_BYTES: %d is below 64 KiB", c.StreamChunkBytes))
	}
	if c.LoadMaxAge < 0 {
		errs = append(errs, fmt.Errorf("KVMESH_LOAD_MAX_AGE: %s is negative", c.LoadMaxAge))
	}
	if c.HeartbeatInterval <= 0 || c.WorkerStaleAfter <= c.HeartbeatInterval {
		errs = append(errs, errors.New("KVMESH_HEARTBEAT_INTERVAL must be positive and below KVMESH_WORKER_STALE_AFTER"))
	}
	if strings.TrimSpace(c.Model) != "" {
		errs = append(errs, c.validateRank())
	}
	return errors.Join(errs...)
}

// validateRank checks that the configured rank is one of the model's worker
// ranks (KVMESH_MODEL with the KVMESH_TP/PCP/DCP/PP overrides), so a worker
// that no sender would ever put through, or that would load another rank's
// namespace, refuses to start.
func (c *Config) validateRank() error {
	m, err := c.LoadModel()
	if err != nil {
		return fmt.Errorf("KVMESH_MODEL: %w", err)
	}
	r := c.Rank()
	if r.TP < 0 || r.PCP < 0 || r.DCP < 0 || r.PP < 0 || m.IsWorkerRank(r) {
		return nil // a negative rank is reported on its own
	}
	return fmt.Errorf("KVMESH_RANK_*: rank %s is not a worker rank of model %s: %s", r, m.Name, validRanks(m, r))
}

// validRanks describes the worker ranks of m for a refused rank r.
func validRanks(m *kvcore.Model, r kvcore.Rank) string {
	p := m.Parallel
	tp, pcp, dcp, pp := max(p.TP, 1), max(p.PCP, 1), max(p.DCP, 1), max(p.PP, 1)
	out := fmt.Sprintf("with tp %d, pcp %d, dcp %d and pp %d the valid ranks are KVMESH_RANK_TP 0..%d, KVMESH_RANK_PCP 0..%d, KVMESH_RANK_PP 0..%d and KVMESH_RANK_DCP = KVMESH_RANK_TP %% %d",
		tp, pcp, dcp, pp, tp-1, pcp-1, pp-1, dcp)
	if r.TP < tp {
		out += fmt.Sprintf(" (%d for KVMESH_RANK_TP %d)", r.TP%dcp, r.TP)
	}
	if ranks := m.WorkerRanks(); len(ranks) <= 16 {
		out += ": " + strings.Join(kvcore.RankNames(ranks), ", ")
	}
	return out
}

// Rank is the configured rank.
func (c *Config) Rank() kvcore.Rank {
	return kvcore.Rank{TP: c.RankTP, PCP: c.RankPCP, DCP: c.RankDCP, PP: c.RankPP}
}

// App is a wired gpuworker, ready to Run.
type App struct {
	cfg      Config
	deps     *service.Deps
	model    *kvcore.Model
	srv      *httpserver.Server
	pool     *pool.Pool
	gpus     *devices.Source
	consumer *bus.Consumer
	// deadLetters keeps the load tasks the consumer gives up on, and
	// replay hands one back to the loader (GET/POST /v1/dlq...).
	deadLetters *deadletter.Store
	replay      *deadletter.HandlerReplayer
	worker      registry.Worker
	// registered is set while the registry holds this worker.
	registered atomic.Bool
	// tierEvents announces the blocks the capacity tier stored (nil: no tier).
	tierEvents *tierevents.Announcer
}

// New opens the service's connections and binds the HTTP address, in a
// fixed order, then allocates the pool and mounts the routes.
func New(ctx context.Context, cfg Config, log *slog.Logger) (_ *App, err error) {
	return NewWithDevices(ctx, cfg, log, devices.NewSystemSource())
}

// NewWithDevices is New with the GPU inventory read from gpus (tests pass
// an NVML mock).
func NewWithDevices(ctx context.Context, cfg Config, log *slog.Logger, gpus *devices.Source) (_ *App, err error) {
	a := &App{cfg: cfg, deps: service.NewDeps(log), gpus: gpus}
	defer func() {
		if err != nil {
			a.deps.Close()
		}
	}()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if a.model, err = cfg.LoadModel(); err != nil {
		return nil, err
	}
	keys, err := kvcore.NewKeyBuilder(cfg.KeyPrefix, a.model)
	if err != nil {
		return nil, err
	}
	if err = a.deps.OpenDatabase(ctx, cfg.DatabaseURL, "kvmesh-gpuworker", false); err != nil {
		return nil, err
	}
	if err = a.deps.OpenStore(ctx, cfg.Store); err != nil {
		return nil, err
	}
	if err = a.deps.OpenTier(ctx, cfg.Tier); err != nil {
		return nil, err
	}
	if err = a.deps.OpenBus(ctx, &cfg.Common); err != nil {
		return nil, err
	}
	if a.deps.Tier != nil {
		if a.tierEvents, err = tierevents.New(tierevents.Options{Publisher: a.deps.Producer, Registry: a.deps.Registry, Logger: a.deps.Log, Form: cfg.KVEventsForm}); err != nil {
			return nil, err
		}
	}
	// Not ready until registered: a sender finds workers in the registry.
	a.deps.AddCheck(httpserver.ReadyCheck{Name: "registry", Check: a.registeredCheck})
	if a.srv, err = a.deps.HTTPServer(cfg.HTTPAddr, "gpuworker", &cfg.Common, service.ForEngine(cfg.EngineID)); err != nil {
		return nil, err
	}
	if a.pool, err = pool.New(a.model, cfg.PoolBlocks); err != nil {
		return nil, err
	}
	m, err := metrics.New(a.deps.Registry, func() []pool.GroupStats { return a.pool.Stats(a.model) }, gpus)
	if err != nil {
		return nil, err
	}
	sm, err := kvstore.NewMetrics(a.deps.Registry)
	if err != nil {
		return nil, err
	}
	// A gpuworker serves one engine: its store calls carry vLLM's base
	// labels from the start (kvstore.VLLMLabels).
	vllmLabels := kvstore.VLLMLabels{ModelName: a.model.Name, Engine: cfg.EngineID}
	loadStore := kvstore.Instrument(a.deps.Blocks, sm, kvstore.OpNames{Get: metrics.OpLoadGet}).WithLabels(vllmLabels)
	if a.consumer, err = a.newConsumer(keys, loadStore, m); err != nil {
		return nil, err
	}
	putStore := kvstore.Instrument(a.deps.Blocks, sm, kvstore.OpNames{Put: metrics.OpSavePut}).WithLabels(vllmLabels)
	dp := dataplaneapi.New(a.pool, putStore, a.model.Fingerprint(), cfg.MaxBatchBytes, m).
		WithStreams(dataplaneapi.Streams{N: cfg.StoreStreams, ChunkBytes: cfg.StreamChunkBytes})
	if st, ok := a.deps.Store.(kvstore.StoreTimes); ok {
		dp.WithStoreTimes(st, time.Now)
	}
	if a.deps.Tier != nil { // the tier's blocks announced; a block promoted into Redis gets its store time too
		a.deps.Tier.OnStored(a.tierEvents.Stored)
		a.deps.Tier.OnPromoted(func(ctx context.Context, keys []string) {
			dp.RecordStored(ctx, keys)
			a.tierEvents.Promoted(keys)
		})
	}
	dp.Mount(a.srv.Router())
	dataplaneapi.NewKVMemory(a.pool, a.model).Mount(a.srv.Router())
	a.mountAPI()
	a.worker = registry.Worker{EngineID: cfg.EngineID, Rank: cfg.Rank(), Addr: dataplaneURL(cfg.DataplaneURL, a.srv.Addr(), cfg.HTTPTLS.CertFile != "")}
	return a, nil
}

// idleCommitInterval is how often the load-task consumer commits handled
// offsets: once a second (and on a clean stop) instead of ten times. A
// crash redelivers at most that second's tasks, which load again and
// publish the same result ids. With one worker per rank (16 for two TP8
// engines) the default kept a small machine busy committing.
const idleCommitInterval = time.Second

// newConsumer builds the load-task consumer of this engine rank.
func (a *App) newConsumer(keys kvcore.KeyBuilder, st kvstore.Store, m *metrics.Metrics) (*bus.Consumer, error) {
	hc, err := a.peerClient()
	if err != nil {
		return nil, err
	}
	// The pd sources, other engines' ranks, found as the sender finds its
	// put targets: one registry read per engine per TTL (registry.Planes).
	sources := registry.NewPlanes(func(ctx context.Context, engineID string) ([]registry.Worker, error) {
		return registry.Find(ctx, a.deps.Pool, engineID, a.cfg.WorkerStaleAfter)
	}, func(addr string) *dataplane.Client { return dataplane.NewClient(addr, hc) }, registry.DefaultPlanesTTL)
	loader := load.New(load.Config{
		Model: a.model, Keys: keys, EngineID: a.cfg.EngineID, Rank: a.cfg.Rank(),
		Pool: a.pool, Store: st, Publisher: a.deps.Producer,
		Remote: sources.Rank, RemoteFailed: sources.Forget,
		MaxBatchBytes: a.cfg.MaxBatchBytes, Streams: a.cfg.StoreStreams, ChunkBytes: a.cfg.StreamChunkBytes, Metrics: m, Log: a.deps.Log, MaxAge: a.cfg.LoadMaxAge,
	})
	group := fmt.Sprintf("kvmesh-gpuworker-%s-%s", a.cfg.EngineID, a.cfg.Rank())
	cc := a.cfg.ConsumerConfig(group, []string{contract.TopicLoadTasks}, a.deps.Log)
	cc.DLQTopic, cc.Producer = contract.TopicLoadDLQ, a.deps.Producer
	cc.CommitInterval = idleCommitInterval
	// A load task given up on is kept in the shared dead_letters table
	// (pkg/deadletter), then published to the DLQ topic.
	a.deadLetters = deadletter.NewStore(a.deps.Pool, deadletter.ServiceGPUWorker)
	a.replay = deadletter.NewHandlerReplayer(a.deadLetters, loader.Handle)
	cc.OnDeadLetter = a.deadLetters.Record(func(ctx context.Context, d deadletter.DeadLetter, cause error) {
		m.Load(load.OutcomeDeadLettered, 0, 0)
		a.deps.Log.ErrorContext(ctx, "load task dead-lettered to "+contract.TopicLoadDLQ+": no result can be published",
			"reason", d.Reason, "err", cause, "partition", d.Partition, "offset", d.Offset)
	})
	if err := a.deps.WatchConsumerLag(cc); err != nil {
		return nil, err
	}
	return bus.NewConsumer(cc, loader.Handle)
}

// dataplaneURL is the configured URL, or http:// (https:// when the worker
// serves HTTPS) plus the bound address with a wildcard host replaced by
// 127.0.0.1.
func dataplaneURL(configured, bound string, https bool) string {
	if configured != "" {
		return strings.TrimRight(configured, "/")
	}
	scheme := "http://"
	if https {
		scheme = "https://"
	}
	host, port, err := net.SplitHostPort(bound)
	if err != nil {
		return scheme + bound
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return scheme + net.JoinHostPort(host, port)
}

// Addr is the bound HTTP address.
func (a *App) Addr() string { return a.srv.Addr() }

// Worker is the registration this worker keeps in the registry.
func (a *App) Worker() registry.Worker { return a.worker }

// Run serves until ctx is cancelled, then releases every connection.
func (a *App) Run(ctx context.Context) error {
	defer a.deps.Close()
	defer a.gpus.Close()
	tasks := []service.Task{
		{Name: "http", Run: a.srv.Run},
		{Name: "load-consumer", Run: a.consumer.Run},
		{Name: "registry", Run: a.keepRegistered},
	}
	if a.tierEvents != nil {
		tasks = append(tasks, service.Task{Name: "tier-events", Run: a.tierEvents.Run})
	}
	return service.Run(ctx, a.deps.Log, tasks...)
}

// keepRegistered registers the worker with its device inventory, heartbeats
// until ctx ends, and then removes the registration. A failed registration
// or heartbeat is logged and retried at the next tick; a registration that
// went missing is renewed.
func (a *App) keepRegistered(ctx context.Context) error {
	devs, err := json.Marshal(a.gpus.Inventory())
	if err != nil {
		return fmt.Errorf("encode devices: %w", err)
	}
	a.worker.Devices = devs
	tick := time.NewTicker(a.cfg.HeartbeatInterval)
	defer tick.Stop()
	registered := false
	for {
		if registered {
			err = registry.Heartbeat(ctx, a.deps.Pool, a.worker.EngineID, a.worker.Rank)
			registered = !errors.Is(err, registry.ErrNoWorker)
		}
		if !registered {
			if err = registry.Register(ctx, a.deps.Pool, a.worker); err == nil {
				registered = true
				a.deps.Log.Info("registered", "engine_id", a.worker.EngineID, "rank", a.worker.Rank, "addr", a.worker.Addr)
			}
		}
		a.registered.Store(registered)
		if err != nil && ctx.Err() == nil {
			a.deps.Log.Warn("worker registry update failed; retrying at the next tick", "err", err)
		}
		select {
		case <-ctx.Done():
			return a.deregister()
		case <-tick.C:
		}
	}
}

// registeredCheck is the readiness check of the registration.
func (a *App) registeredCheck(context.Context) error {
	if !a.registered.Load() {
		return errNotRegistered
	}
	return nil
}

// deregister removes the registration on a clean stop, so no sender picks
// a stopped worker.
func (a *App) deregister() error {
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
	defer cancel()
	if err := registry.Deregister(ctx, a.deps.Pool, a.worker.EngineID, a.worker.Rank); err != nil {
		a.deps.Log.Warn("deregister failed; the registration goes stale", "err", err)
	}
	return nil
}
