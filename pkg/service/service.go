// Package service is the runtime every kvmesh service runs in: the settings
// they share, the one Main that turns configuration into a logger, traces
// and a signal-aware context, and Run, which runs a service's named tasks
// together and stops them all when one fails.
package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/logging"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Common holds the settings every kvmesh service shares. Each service's
// Config embeds it.
type Common struct {
	// LogLevel is the minimum level logged.
	LogLevel string `env:"KVMESH_LOG_LEVEL" doc:"log level: debug, info, warn or error"`
	// KafkaBrokers are the Kafka bootstrap brokers.
	KafkaBrokers
	// Kafka is the TLS and SASL security of every Kafka connection.
	Kafka bus.Security
	// Partitions is the partition count used when a service creates a missing topic.
	Partitions int `env:"KVMESH_KAFKA_PARTITIONS" doc:"partitions for topics a service creates when they are missing"`
	// Admin is the operator token that guards the admin routes.
	Admin
	// Auth is how routes are authenticated (engine and service tokens).
	Auth auth.Config
	// HTTPTLS is the TLS of the HTTP server and of calls to other services.
	HTTPTLS HTTPTLS
	// ShutdownTimeout bounds the graceful stop.
	ShutdownTimeout time.Duration `env:"KVMESH_SHUTDOWN_TIMEOUT" doc:"how long a service waits for in-flight work when stopping"`
	// ModelSpec is a preset name or the path of a YAML/JSON model spec.
	ModelSpec
	// Parallel overrides the model spec's parallel sizes (zero keeps the spec's).
	Parallel ParallelOverride
	// KeyPrefix separates deployments that share one store pool.
	KeyPrefix string `env:"KVMESH_KEY_PREFIX" doc:"store-key prefix separating deployments that share a store pool (no '@' or whitespace; must be the same in every service); empty for none"`
	// SessionTimeout is the Kafka consumer-group session timeout.
	SessionTimeout time.Duration `env:"KVMESH_KAFKA_SESSION_TIMEOUT" doc:"Kafka consumer-group session timeout: how soon a crashed member's partitions go to another"`
	// Telemetry is where traces are exported.
	Telemetry
	// CPUProfile is where the process writes a CPU profile of its whole run.
	CPUProfile string `env:"KVMESH_CPU_PROFILE" doc:"file the service writes a Go CPU profile of its whole run to (pprof format, written when it stops); empty for none. For measuring where a service spends its CPU (make bench's mesh_cpu_per_request uses it with KVMESH_BENCH_PROFILE_DIR)"`
}

// SetDefaults gives the shared settings' defaults (config.Defaulter); the
// brokers' and the model's are KafkaBrokers' and ModelSpec's. Most are owned by other packages: the contract's
// partition count, the HTTP server's shutdown timeout and the consumer's
// session timeout.
func (c *Common) SetDefaults() {
	c.LogLevel = "info"
	c.Partitions = contract.DefaultPartitions
	c.ShutdownTimeout = httpserver.DefaultShutdownTimeout
	c.SessionTimeout = bus.DefaultSessionTimeout
}

// Validate checks the shared settings.
func (c *Common) Validate() error {
	var errs []error
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("KVMESH_KAFKA_BROKERS: at least one broker is required"))
	}
	if c.Partitions < 1 {
		errs = append(errs, fmt.Errorf("KVMESH_KAFKA_PARTITIONS: %d is not positive", c.Partitions))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("KVMESH_SHUTDOWN_TIMEOUT: %s is not positive", c.ShutdownTimeout))
	}
	if _, err := logging.ParseLevel(c.LogLevel); err != nil {
		errs = append(errs, fmt.Errorf("KVMESH_LOG_LEVEL: %w", err))
	}
	if err := (kvcore.KeyBuilder{Prefix: c.KeyPrefix, Model: "model"}).Validate(); err != nil {
		errs = append(errs, fmt.Errorf("KVMESH_KEY_PREFIX: %w", err))
	}
	if err := c.Kafka.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.SessionTimeout < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("KVMESH_KAFKA_SESSION_TIMEOUT: %s is below 100ms", c.SessionTimeout))
	}
	for _, d := range []struct {
		name string
		v    int
	}{{"KVMESH_TP", c.Parallel.TP}, {"KVMESH_PCP", c.Parallel.PCP}, {"KVMESH_DCP", c.Parallel.DCP}, {"KVMESH_PP", c.Parallel.PP}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s: %d is negative", d.name, d.v))
		}
	}
	if err := c.Auth.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.HTTPTLS.validate(); err != nil {
		errs = append(errs, err)
	}
	if strings.TrimSpace(c.Model) == "" {
		errs = append(errs, errors.New("KVMESH_MODEL: a preset name or a spec file is required"))
	}
	return errors.Join(errs...)
}

// ConsumerConfig is the base of a service's consumer-group settings: the
// brokers and their TLS and SASL security, the group and its topics, the
// logger, and session, heartbeat
// and rebalance timeouts derived from SessionTimeout. Callers add their
// dead-letter hook and retry policy.
func (c *Common) ConsumerConfig(group string, topics []string, log *slog.Logger) bus.ConsumerConfig {
	session := c.SessionTimeout
	return bus.ConsumerConfig{
		Brokers:           c.Brokers,
		Security:          c.Kafka,
		GroupID:           group,
		Topics:            topics,
		Logger:            log,
		SessionTimeout:    session,
		HeartbeatInterval: min(bus.DefaultHeartbeatInterval, session/5),
		// A member that stops while its group is rebalancing waits in
		// JoinGroup for up to the rebalance timeout, so it is kept well
		// under the 5 s a service has to stop.
		RebalanceTimeout: min(maxRebalanceTimeout, max(session, time.Second)),
	}
}

// maxRebalanceTimeout bounds how long a stopping member can be held in a
// rebalance; heartbeats (at most 1 s apart) let members rejoin well within it.
const maxRebalanceTimeout = 2 * time.Second

// Configurable is a service's Config: a struct pointer that config.Load
// fills and that exposes its Common part.
type Configurable interface {
	// Shared returns the embedded Common settings.
	Shared() *Common
}

// Shared returns c itself, so that a Config embedding Common is Configurable.
func (c *Common) Shared() *Common { return c }

// ParallelOverride sets an engine's parallel layout over the model spec's,
// so one spec serves at several sizes. Every service of a mesh (and the
// engines) must use the same values: they are part of the model's
// fingerprint.
type ParallelOverride struct {
	// TP overrides parallel.tp.
	TP int `env:"KVMESH_TP" doc:"tensor-parallel size of the engines, over the model spec's parallel.tp (0: the spec's); the same in every service"`
	// PCP overrides parallel.pcp.
	PCP int `env:"KVMESH_PCP" doc:"prefill context-parallel size, over the spec's parallel.pcp (0: the spec's)"`
	// DCP overrides parallel.dcp.
	DCP int `env:"KVMESH_DCP" doc:"decode context-parallel size, over the spec's parallel.dcp (0: the spec's)"`
	// PP overrides parallel.pp.
	PP int `env:"KVMESH_PP" doc:"pipeline-parallel size, over the spec's parallel.pp (0: the spec's)"`
}

// Apply sets the non-zero sizes on m, derives the block sizes given as
// cache block sizes for the new layout (kvcore.Model.Resolve) and
// validates the result: a layout vLLM refuses is an error naming it.
func (o ParallelOverride) Apply(m *kvcore.Model) error {
	for _, d := range []struct {
		v   int
		dst *int
	}{{o.TP, &m.Parallel.TP}, {o.PCP, &m.Parallel.PCP}, {o.DCP, &m.Parallel.DCP}, {o.PP, &m.Parallel.PP}} {
		if d.v != 0 {
			*d.dst = d.v
		}
	}
	return m.Resolve()
}

// LoadModel resolves KVMESH_MODEL and applies the parallel overrides.
func (c *Common) LoadModel() (*kvcore.Model, error) {
	m, err := LoadModel(c.Model)
	if err != nil {
		return nil, err
	}
	if err := c.Parallel.Apply(m); err != nil {
		return nil, fmt.Errorf("KVMESH_MODEL %s with KVMESH_TP/PCP/DCP/PP: %w", c.Model, err)
	}
	return m, nil
}

// LoadModels resolves the served models: KVMESH_MODEL (the default, with
// the parallel overrides) and KVMESH_MODELS, with their keys under the
// deployment's prefix.
func (c *Common) LoadModels() (*kvcore.Models, error) {
	def, err := c.LoadModel()
	if err != nil {
		return nil, err
	}
	ms := []*kvcore.Model{def}
	for _, spec := range c.Models {
		m, err := LoadModel(strings.TrimSpace(spec))
		if err != nil {
			return nil, fmt.Errorf("KVMESH_MODELS: %w", err)
		}
		ms = append(ms, m)
	}
	r, err := kvcore.NewModels(c.KeyPrefix, ms...)
	if err != nil {
		return nil, fmt.Errorf("KVMESH_MODEL and KVMESH_MODELS: %w", err)
	}
	return r, nil
}

// LoadModel resolves a KVMESH_MODEL value: a preset name, else a file path.
func LoadModel(spec string) (*kvcore.Model, error) {
	if m, err := kvcore.Preset(spec); err == nil {
		return m, nil
	}
	data, err := os.ReadFile(spec)
	if err != nil {
		return nil, fmt.Errorf("model %q is neither a preset (%s) nor a readable file: %w",
			spec, strings.Join(kvcore.PresetNames(), ", "), err)
	}
	return kvcore.ParseModel(data)
}

// Main is the whole body of a service's main function: it loads cfg from
// the environment, builds the JSON logger, logs the resolved settings with
// secrets masked, sets up tracing, runs run under a context cancelled by
// SIGINT or SIGTERM, flushes traces, and returns the process exit code
// (0 on a clean stop, 1 when run failed, 2 for bad configuration).
func Main(name string, cfg Configurable, run func(ctx context.Context, log *slog.Logger) error, opts ...MainOption) int {
	return runMain(name, cfg, os.LookupEnv, os.Stderr, run, opts...)
}

// MainOption tunes what Main sets up.
type MainOption func(*mainOptions)

type mainOptions struct{ gcPercent int }

// ControlPlaneGCPercent is the garbage collector's target (GOGC) of the
// control-plane services (scheduler, sender, lookup): their live heaps are
// small (tens of MiB), and collecting at five times it instead of twice
// cut the scheduler's CPU per request by a fifth on the seed run. The
// gpuworker keeps Go's 100: its pool may live in its heap.
const ControlPlaneGCPercent = 400

// WithGCPercent has Main set the garbage collector's target percentage
// (runtime/debug.SetGCPercent) to p, unless the GOGC environment variable
// sets it.
func WithGCPercent(p int) MainOption {
	return func(o *mainOptions) { o.gcPercent = p }
}

func runMain(name string, cfg Configurable, lookup func(string) (string, bool), stderr io.Writer,
	run func(ctx context.Context, log *slog.Logger) error, opts ...MainOption) int {
	var o mainOptions
	for _, opt := range opts {
		opt(&o)
	}
	if err := config.Load(cfg, lookup); err != nil {
		fmt.Fprintf(stderr, "%s: configuration: %v\n", name, err)
		return 2
	}
	if _, set := lookup("GOGC"); o.gcPercent > 0 && !set {
		debug.SetGCPercent(o.gcPercent)
	}
	common := cfg.Shared()
	log, err := logging.New(stderr, common.LogLevel, name)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	log.Info("starting", "config", config.LogValue(cfg))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	shutdownTraces, err := telemetry.Setup(ctx, telemetry.Options{
		ServiceName:        "kvmesh-" + name,
		OTLPEndpoint:       common.OTLPEndpoint,
		OTLPTracesEndpoint: common.OTLPTracesEndpoint,
		Logger:             log,
	})
	if err != nil {
		log.Error("telemetry setup failed", "err", err)
		return 1
	}
	stopProfile, err := startCPUProfile(common.CPUProfile)
	if err != nil {
		log.Error("cpu profile", "err", err)
		return 2
	}
	defer stopProfile()
	code := 0
	if err := run(ctx, log); err != nil {
		log.Error("stopped with error", "err", err)
		code = 1
	} else {
		log.Info("stopped")
	}
	flushCtx, cancel := context.WithTimeout(context.Background(), common.ShutdownTimeout)
	defer cancel()
	if err := shutdownTraces(flushCtx); err != nil {
		log.Warn("flushing traces failed", "err", err)
	}
	return code
}

// Task is one named long-running part of a service: an HTTP server, a
// consumer, a relay.
type Task struct {
	// Name appears in logs and in the error of a failed task.
	Name string
	// Run works until ctx is cancelled and then returns nil, or returns an
	// error when it cannot go on.
	Run func(ctx context.Context) error
}

// Run runs tasks together until ctx is cancelled or one of them fails; a
// failure cancels the others. It returns once every task has returned, with
// the first failure wrapped with its task's name, or nil.
func Run(ctx context.Context, log *slog.Logger, tasks ...Task) error {
	g, gctx := errgroup.WithContext(ctx)
	for _, t := range tasks {
		g.Go(func() error {
			log.Debug("task started", "task", t.Name)
			if err := t.Run(gctx); err != nil {
				return fmt.Errorf("%s: %w", t.Name, err)
			}
			log.Debug("task stopped", "task", t.Name)
			return nil
		})
	}
	return g.Wait()
}

// startCPUProfile starts a CPU profile into path (nothing when path is
// empty) and returns what stops it and closes the file.
func startCPUProfile(path string) (func(), error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", path, err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("start: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}, nil
}
