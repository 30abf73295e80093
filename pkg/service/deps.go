package service

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// Deps are the connections a service opens at start, each registering its
// readiness check; Close releases them in reverse order. Services open them
// in a fixed order in their New: database, store, bus, then HTTP.
type Deps struct {
	// Log is the service's logger.
	Log *slog.Logger
	// Registry receives the service's Prometheus metrics.
	Registry *prometheus.Registry
	// Pool is the PostgreSQL pool, after OpenDatabase.
	Pool *pgxpool.Pool
	// Store is the store pool (Redis), after OpenStore.
	Store kvstore.Store
	// Blocks is the store of block bytes, after OpenStore and OpenTier:
	// the Tier over Store when a capacity tier is configured, else Store
	// itself. The lookup's existence checks and the gpuworkers' puts and
	// loads use it; Redis-only checks (the sender's, the score's) and
	// Redis's own indexes (store times, quotas) use Store.
	Blocks kvstore.Store
	// Tier is the capacity tier, after OpenTier (nil: none).
	Tier *kvtier.Tier
	// Producer publishes to Kafka, after OpenBus.
	Producer *bus.Producer

	checks  []httpserver.ReadyCheck
	closers []func()
	lag     *bus.LagCollector
}

// NewDeps returns an empty set with a fresh metrics registry.
func NewDeps(log *slog.Logger) *Deps {
	return &Deps{Log: log, Registry: prometheus.NewRegistry()}
}

// OpenDatabase connects to PostgreSQL. With migrate set it applies the
// pending migrations (the scheduler owns them); either way readiness
// requires every migration to be applied.
func (d *Deps) OpenDatabase(ctx context.Context, url, appName string, migrate bool) error {
	pool, err := database.Connect(ctx, url, database.WithApplicationName(appName))
	if err != nil {
		return err
	}
	d.Pool = pool
	d.closers = append(d.closers, pool.Close)
	if migrate {
		applied, err := database.Migrate(ctx, pool, migrations.FS)
		if err != nil {
			return err
		}
		d.Log.Info("migrations applied", "applied", applied)
	}
	d.checks = append(d.checks, httpserver.ReadyCheck{Name: "postgres", Check: func(ctx context.Context) error {
		if err := pool.Ping(ctx); err != nil {
			return err
		}
		return database.CheckMigrated(ctx, pool, migrations.FS)
	}})
	return nil
}

// OpenStore connects to the Redis store pool of s, over TLS as its files
// say for a rediss:// URL; the service is not ready while the store does
// not answer.
func (d *Deps) OpenStore(ctx context.Context, s Store) error {
	return d.openStore(ctx, s, false)
}

// OpenOptionalStore connects to the Redis store pool, as OpenStore does,
// for a service that keeps serving without it (the lookup, whose store
// child fails open): a store that does not answer leaves the service
// ready, and /readyz lists it as failed and degraded
// (httpserver.ReadyCheck.Optional).
func (d *Deps) OpenOptionalStore(ctx context.Context, s Store) error {
	return d.openStore(ctx, s, true)
}

func (d *Deps) openStore(ctx context.Context, s Store, optional bool) error {
	st, err := kvstore.NewRedis(ctx, s.RedisURL, kvstore.RedisOptions{TLS: s.RedisTLS})
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	d.Store, d.Blocks = st, st
	d.closers = append(d.closers, func() { _ = st.Close() })
	d.checks = append(d.checks, httpserver.ReadyCheck{Name: "store", Optional: optional, Check: st.Ping})
	return nil
}

// OpenTier connects to the capacity tier of s, when it names one, and puts
// it over the store (Blocks); call it after OpenStore. A tier that does
// not answer at start is an error (a misnamed bucket must not pass for an
// empty one); later, its readiness check is optional: a mesh whose tier is
// down serves from Redis, and its loads from the tier fail closed.
func (d *Deps) OpenTier(ctx context.Context, s Tier) error {
	if s.TierURL == "" {
		return nil
	}
	obj, err := kvtier.Open(ctx, kvtier.Config{URL: s.TierURL, AccessKey: s.TierAccessKey, SecretKey: s.TierSecretKey,
		Region: s.TierRegion, Timeout: s.TierTimeout})
	if err != nil {
		return fmt.Errorf("capacity tier: %w", err)
	}
	m, err := kvtier.NewMetrics(d.Registry)
	if err != nil {
		return err
	}
	t := kvtier.New(d.Store, obj, m, kvtier.Options{QueueBytes: s.TierQueueBytes, Log: d.Log})
	d.Tier, d.Blocks = t, t
	d.closers = append(d.closers, func() { _ = t.Close() })
	d.checks = append(d.checks, httpserver.ReadyCheck{Name: "tier", Optional: true, Check: obj.Ping})
	d.Log.Info("capacity tier on", "endpoint", obj.Location().Endpoint, "bucket", obj.Location().Bucket, "prefix", obj.Location().Prefix)
	return nil
}

// OpenBus makes sure every contract topic exists and creates the producer
// with opts (the lookup, whose every publish is on an engine's critical
// path, sends each record at once). Every connection, the readiness ping's
// too, uses c.Kafka's TLS and SASL settings.
func (d *Deps) OpenBus(ctx context.Context, c *Common, opts ...bus.ProducerOption) error {
	sec := bus.WithSecurity(c.Kafka)
	if err := bus.EnsureTopics(ctx, c.Brokers, contract.Topics, c.Partitions, sec); err != nil {
		return err
	}
	p, err := bus.NewProducer(c.Brokers, append([]bus.ProducerOption{sec}, opts...)...)
	if err != nil {
		return err
	}
	d.Producer = p
	d.closers = append(d.closers, func() { _ = p.Close() })
	brokers := c.Brokers
	d.checks = append(d.checks, httpserver.ReadyCheck{Name: "kafka", Check: func(ctx context.Context) error {
		return bus.Ping(ctx, brokers, sec)
	}})
	return nil
}

// WatchConsumerLag reports the lag of cc's consumer group on cc's topics as
// kvmesh_consumer_lag on the service's registry (read from the brokers at
// scrape time), connecting with cc.Security. Watching one group several
// times is harmless.
func (d *Deps) WatchConsumerLag(cc bus.ConsumerConfig) error {
	if d.lag == nil {
		lag := bus.NewLagCollector(cc.Brokers, bus.WithSecurity(cc.Security))
		if err := d.Registry.Register(lag); err != nil {
			lag.Close()
			return fmt.Errorf("register consumer lag: %w", err)
		}
		d.lag = lag
		d.closers = append(d.closers, lag.Close)
	}
	d.lag.Watch(cc.GroupID, cc.Topics...)
	return nil
}

// AddCheck registers a service's own readiness check; call it before
// HTTPServer.
func (d *Deps) AddCheck(c httpserver.ReadyCheck) {
	d.checks = append(d.checks, c)
}

// ServerOption adjusts the HTTP server HTTPServer builds.
type ServerOption func(*httpserver.Options)

// ForEngine makes the server refuse engine credentials of engines other
// than engineID (a gpuworker serves one engine).
func ForEngine(engineID string) ServerOption {
	return func(o *httpserver.Options) { o.EngineID = engineID }
}

// HTTPServer creates the service's HTTP server with every readiness check
// registered so far and binds its address, so Addr is known before Run.
// The server authenticates its routes as c.Auth says (the rules come from
// the OpenAPI document the service gives ServeOpenAPI) and serves HTTPS
// when c.HTTPTLS names a certificate.
func (d *Deps) HTTPServer(addr, name string, c *Common, opts ...ServerOption) (*httpserver.Server, error) {
	verifier, err := c.Auth.Verifier(c.AdminToken)
	if err != nil {
		return nil, err
	}
	tlsCfg, err := c.HTTPTLS.Server()
	if err != nil {
		return nil, err
	}
	o := httpserver.Options{
		Addr:            addr,
		Service:         name,
		Logger:          d.Log,
		Ready:           d.checks,
		Registry:        d.Registry,
		AdminToken:      c.AdminToken,
		ShutdownTimeout: c.ShutdownTimeout,
		Auth:            verifier,
		TLS:             tlsCfg,
	}
	for _, opt := range opts {
		opt(&o)
	}
	srv, err := httpserver.New(o)
	if err != nil {
		return nil, err
	}
	if err := srv.Listen(); err != nil {
		return nil, err
	}
	d.closers = append(d.closers, func() { _ = srv.Close() })
	return srv, nil
}

// Close releases everything opened, newest first.
func (d *Deps) Close() {
	for i := len(d.closers) - 1; i >= 0; i-- {
		d.closers[i]()
	}
	d.closers = nil
}
