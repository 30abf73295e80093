package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

func init() {
	register("sim", "play inference engines against the running mesh and print a verified report", runSim)
}

// errSimFailed reports a run whose report is not OK (failed requests, byte
// mismatches, wrong stored values or an unbalanced save ledger).
var errSimFailed = errors.New("simulation failed")

// runSim parses the flags, runs the simulation, prints the report and fails
// unless the report is OK.
func runSim(ctx context.Context, args []string) error {
	opts, err := simFlags(args)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: opts.logLevel}))
	opts.cfg.Log = logger
	shutdown, err := telemetry.Setup(ctx, telemetry.Options{
		ServiceName: "kvmesh-sim", Logger: logger,
		OTLPEndpoint: os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT"), OTLPTracesEndpoint: os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
	})
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := shutdown(sctx); err != nil {
			logger.Warn("flushing traces", "err", err)
		}
	}()
	bar := newProgressBar(stderr, opts.progress)
	opts.cfg.Progress, opts.cfg.ProgressEvery = bar.update, bar.every
	rep, err := sim.Run(ctx, opts.cfg)
	bar.done()
	if err != nil {
		return err
	}
	if err := writeSimReport(os.Stdout, rep, opts.json); err != nil {
		return err
	}
	if !rep.OK {
		wrong := 0
		if rep.Stored != nil {
			wrong = rep.Stored.Wrong
		}
		return fmt.Errorf("%w: %d of %d requests failed, %d blocks mismatched, %d stored values wrong, ledger %s",
			errSimFailed, rep.Requests.Failed, rep.Requests.Total, rep.Verification.Mismatched, wrong, map[bool]string{true: "balanced", false: "not balanced"}[rep.Ledger.Balanced])
	}
	return nil
}

func writeSimReport(w io.Writer, rep *sim.Report, asJSON bool) error {
	if !asJSON {
		return rep.WriteText(w)
	}
	return writeValue(w, rep)
}

// simOptions is what the sim command line says.
type simOptions struct {
	cfg      sim.Config
	json     bool
	progress string
	logLevel slog.Level
}

// simPreset is a named starting point for the flags.
type simPreset struct {
	summary  string
	model    string
	pd       bool
	workload sim.Workload
	engine   sim.EngineConfig
	// reusePreempted frees preempted requests' blocks at once, even with
	// saves in flight (sim.Config.ReusePreempted).
	reusePreempted bool
}

// simPresets are the shipped workloads. "seed" is the configuration of the
// seed bug report: a 2-group hybrid model (MLA + linear attention), 1P1D
// with the pd,store connector chain, and a deliberately small GPU pool so
// prefixes are evicted and must be reloaded, and requests are preempted
// with their blocks reused at once while saves of them are in flight (8
// conversations a second keep the decode engine's pool under pressure).
var simPresets = map[string]simPreset{
	"seed": {
		summary: "hybrid-mla-linear, 1P1D (pd,store), small pool, 300 requests",
		model:   "hybrid-mla-linear", pd: true,
		workload: sim.Workload{Requests: 300, Turns: sim.Range{Min: 2, Max: 5}, SystemPrompts: 4,
			SystemTokens: sim.Range{Min: 128, Max: 512}, UserTokens: sim.Range{Min: 16, Max: 160},
			OutputTokens: sim.Range{Min: 8, Max: 48}, Rate: 8, ThinkTime: 20 * time.Millisecond, Seed: 54643, Vocab: 32000},
		engine:         sim.EngineConfig{PoolBlocks: 192, MaxBatchTokens: 512, MaxRunning: 16, Watermark: 2},
		reusePreempted: true,
	},
	"smoke": {
		summary: "hybrid-mla-linear, one engine, 16 requests",
		model:   "hybrid-mla-linear",
		workload: sim.Workload{Requests: 16, Turns: sim.Range{Min: 2, Max: 3}, SystemPrompts: 2,
			SystemTokens: sim.Range{Min: 64, Max: 128}, UserTokens: sim.Range{Min: 8, Max: 48},
			OutputTokens: sim.Range{Min: 4, Max: 20}, Rate: 8, Seed: 1, Vocab: 32000},
		engine: sim.EngineConfig{PoolBlocks: 64, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1},
	},
	"dense": {
		summary: "dense-8b (2 MiB blocks), one engine, 40 requests",
		model:   "dense",
		workload: sim.Workload{Requests: 40, Turns: sim.Range{Min: 2, Max: 4}, SystemPrompts: 2,
			SystemTokens: sim.Range{Min: 64, Max: 256}, UserTokens: sim.Range{Min: 16, Max: 64},
			OutputTokens: sim.Range{Min: 8, Max: 32}, Rate: 4, Seed: 2, Vocab: 32000},
		engine: sim.EngineConfig{PoolBlocks: 96, MaxBatchTokens: 512, MaxRunning: 8, Watermark: 1},
	},
	"swa": {
		summary: "full-swa-mamba (3 groups), 1P1D, 80 requests",
		model:   "full-swa-mamba", pd: true,
		workload: sim.Workload{Requests: 80, Turns: sim.Range{Min: 2, Max: 4}, SystemPrompts: 3,
			SystemTokens: sim.Range{Min: 128, Max: 384}, UserTokens: sim.Range{Min: 16, Max: 128},
			OutputTokens: sim.Range{Min: 8, Max: 40}, Rate: 4, Seed: 3, Vocab: 32000},
		engine: sim.EngineConfig{PoolBlocks: 160, MaxBatchTokens: 512, MaxRunning: 12, Watermark: 2},
	},
}

// simValues holds the flags a preset supplies defaults for; they apply only
// when given on the command line.
type simValues struct {
	preset, model, turns, system, user, output, brokers, level string
	requests, sysPrompts, pool, batch, running, watermark      int
	rate                                                       float64
	think, reqTimeout, settle                                  time.Duration
	seed                                                       uint64
	pd, fresh, reusePreempted                                  bool
}

// simFlags reads the command line: a preset gives every default, explicit
// flags override it, and addresses default to the environment and to
// scripts/stack.sh's ports.
func simFlags(args []string) (*simOptions, error) {
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o simOptions
	var v simValues
	defineWorkloadFlags(fs, &v)
	defineMeshFlags(fs, &o, &v)
	rest, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	if len(rest) > 0 {
		return nil, fmt.Errorf("%w: unexpected arguments %q", errUsage, rest)
	}
	if err := applyPreset(fs, &o, &v); err != nil {
		return nil, err
	}
	return &o, finishOptions(&o, &v)
}

// defineWorkloadFlags defines the preset-backed flags.
func defineWorkloadFlags(fs *flag.FlagSet, v *simValues) {
	fs.StringVar(&v.preset, "preset", "seed", "starting point: "+presetList())
	fs.StringVar(&v.model, "model", "", "model preset or spec file; must be the services' KVMESH_MODEL (default: the preset's)")
	fs.BoolVar(&v.pd, "pd", false, "1P1D: a prefill engine hands prompts to the decode engine through the pd connector (default: the preset's)")
	fs.IntVar(&v.requests, "requests", 0, "requests (conversation turns) in all")
	fs.StringVar(&v.turns, "turns", "", "turns per conversation, N or MIN-MAX")
	fs.IntVar(&v.sysPrompts, "system-prompts", 0, "distinct system prompts shared by the conversations")
	fs.StringVar(&v.system, "system-tokens", "", "system prompt length, N or MIN-MAX")
	fs.StringVar(&v.user, "user-tokens", "", "user message length, N or MIN-MAX")
	fs.StringVar(&v.output, "output-tokens", "", "reply length, N or MIN-MAX")
	fs.Float64Var(&v.rate, "rate", 0, "conversations started per second (0: all at once)")
	fs.DurationVar(&v.think, "think-time", 0, "pause between a reply and the next turn")
	fs.Uint64Var(&v.seed, "seed", 0, "workload seed")
	fs.IntVar(&v.pool, "pool-blocks", 0, "KV blocks per group per engine (capped at the gpuworker's KVMESH_POOL_BLOCKS)")
	fs.IntVar(&v.batch, "max-batch-tokens", 0, "token budget of one engine step (chunked prefill)")
	fs.IntVar(&v.running, "max-running", 0, "most requests running at once per engine")
	fs.IntVar(&v.watermark, "watermark", 0, "free blocks per group admission keeps for running requests")
	fs.BoolVar(&v.reusePreempted, "reuse-preempted", false, "free a preempted request's blocks at once, even while saves of them are in flight, as vLLM does (default: the preset's; on for seed)")
}

// defineMeshFlags defines the addresses and the run's own settings.
func defineMeshFlags(fs *flag.FlagSet, o *simOptions, v *simValues) {
	fs.StringVar(&o.cfg.LookupURL, "lookup", envOr("KVMESH_LOOKUP_URL", "http://127.0.0.1:8081"), "lookup service base URL (env KVMESH_LOOKUP_URL)")
	fs.StringVar(&o.cfg.SchedulerURL, "scheduler", envOr("KVMESH_SCHEDULER_URL", "http://127.0.0.1:8082"), "scheduler base URL, asked after the run whether every tracker is done; empty skips the check (env KVMESH_SCHEDULER_URL)")
	fs.StringVar(&o.cfg.RedisURL, "redis", os.Getenv("KVMESH_REDIS_URL"), "the store pool's Redis URL, read after the run to check every value the run's saves stored; empty skips the check (env KVMESH_REDIS_URL)")
	fs.StringVar(&o.cfg.SenderURL, "sender", envOr("KVMESH_SENDER_URL", "http://127.0.0.1:8083"), "sender base URL, asked after the run for its dead letters; empty skips the check (env KVMESH_SENDER_URL)")
	fs.StringVar(&o.cfg.Decode.WorkerURL, "worker", envOr("KVMESH_WORKER_URL", "http://127.0.0.1:8084"), "the (decode) engine's gpuworker base URL (env KVMESH_WORKER_URL)")
	fs.StringVar(&o.cfg.Prefill.WorkerURL, "prefill-worker", envOr("KVMESH_PREFILL_WORKER_URL", "http://127.0.0.1:8085"), "the prefill engine's gpuworker base URL, with -pd (env KVMESH_PREFILL_WORKER_URL)")
	fs.StringVar(&o.cfg.Decode.EngineID, "engine", "", "the (decode) engine's id (default: the worker's)")
	fs.StringVar(&o.cfg.Prefill.EngineID, "prefill-engine", "", "the prefill engine's id (default: the prefill worker's)")
	fs.StringVar(&v.brokers, "brokers", defaultBrokers(), "Kafka bootstrap brokers, comma-separated (env KVMESH_KAFKA_BROKERS, else .dev/broker.addr)")
	fs.StringVar(&o.cfg.RunTag, "run-tag", "", "prefix of every request id (default a random sim-xxxxxx)")
	fs.BoolVar(&v.fresh, "fresh", true, "salt the block hashes with the run tag, so the run starts with a cold store; false shares store keys with earlier runs of the same workload")
	fs.DurationVar(&v.reqTimeout, "request-timeout", time.Minute, "longest wait for a finished_recving or finished_sending, for blocks at the head of the queue, and for a failing lookup, broker or gpuworker to come back")
	fs.DurationVar(&v.settle, "settle-timeout", 30*time.Second, "longest wait for the last save results after the last request")
	fs.BoolVar(&o.json, "json", false, "print the report as JSON")
	fs.StringVar(&o.progress, "progress", "auto", "progress on stderr: auto (a bar on a terminal, log lines otherwise), bar, log, off")
	fs.StringVar(&v.level, "log-level", "warn", "log level on stderr: debug, info, warn, error")
}

// applyPreset starts from the preset and applies the flags given.
func applyPreset(fs *flag.FlagSet, o *simOptions, v *simValues) error {
	p, ok := simPresets[v.preset]
	if !ok {
		return fmt.Errorf("%w: unknown preset %q (have %s)", errUsage, v.preset, presetList())
	}
	o.cfg.Workload, o.cfg.Engine, o.cfg.PD, o.cfg.ReusePreempted = p.workload, p.engine, p.pd, p.reusePreempted
	if v.model == "" {
		v.model = p.model
	}
	w, e := &o.cfg.Workload, &o.cfg.Engine
	overrides := map[string]func() error{
		"pd":               func() error { o.cfg.PD = v.pd; return nil },
		"reuse-preempted":  func() error { o.cfg.ReusePreempted = v.reusePreempted; return nil },
		"requests":         func() error { w.Requests = v.requests; return nil },
		"system-prompts":   func() error { w.SystemPrompts = v.sysPrompts; return nil },
		"rate":             func() error { w.Rate = v.rate; return nil },
		"think-time":       func() error { w.ThinkTime = v.think; return nil },
		"seed":             func() error { w.Seed = v.seed; return nil },
		"pool-blocks":      func() error { e.PoolBlocks = v.pool; return nil },
		"max-batch-tokens": func() error { e.MaxBatchTokens = v.batch; return nil },
		"max-running":      func() error { e.MaxRunning = v.running; return nil },
		"watermark":        func() error { e.Watermark = v.watermark; return nil },
		"turns":            func() (err error) { w.Turns, err = sim.ParseRange(v.turns); return err },
		"system-tokens":    func() (err error) { w.SystemTokens, err = sim.ParseRange(v.system); return err },
		"user-tokens":      func() (err error) { w.UserTokens, err = sim.ParseRange(v.user); return err },
		"output-tokens":    func() (err error) { w.OutputTokens, err = sim.ParseRange(v.output); return err },
	}
	var err error
	fs.Visit(func(f *flag.Flag) {
		if apply := overrides[f.Name]; apply != nil && err == nil {
			if aerr := apply(); aerr != nil {
				err = fmt.Errorf("%w: -%s: %w", errUsage, f.Name, aerr)
			}
		}
	})
	return err
}

// finishOptions resolves the model, the log level, the brokers and the run
// tag and salt.
func finishOptions(o *simOptions, v *simValues) error {
	m, err := service.LoadModel(v.model)
	if err != nil {
		return fmt.Errorf("%w: -model: %w", errUsage, err)
	}
	if err := o.logLevel.UnmarshalText([]byte(v.level)); err != nil {
		return fmt.Errorf("%w: -log-level: %w", errUsage, err)
	}
	switch o.progress {
	case "auto", "bar", "log", "off":
	default:
		return fmt.Errorf("%w: -progress %q: want auto, bar, log or off", errUsage, o.progress)
	}
	o.cfg.Model, o.cfg.Brokers = m, splitList(v.brokers)
	o.cfg.RequestTimeout, o.cfg.SettleTimeout = v.reqTimeout, v.settle
	if o.cfg.RunTag == "" {
		o.cfg.RunTag = sim.NewRunTag()
	}
	if v.fresh {
		o.cfg.Salt = o.cfg.RunTag
	}
	return nil
}

func presetList() string {
	var out []string
	for _, name := range []string{"seed", "smoke", "dense", "swa"} {
		out = append(out, fmt.Sprintf("%s (%s)", name, simPresets[name].summary))
	}
	return strings.Join(out, "; ")
}

// defaultBrokers is KVMESH_KAFKA_BROKERS, else the address scripts/stack.sh
// wrote to .dev/broker.addr (searched from the working directory up), else
// the default broker address.
func defaultBrokers() string {
	if v := os.Getenv("KVMESH_KAFKA_BROKERS"); v != "" {
		return v
	}
	dir, err := os.Getwd()
	for err == nil {
		if b, rerr := os.ReadFile(filepath.Join(dir, ".dev", "broker.addr")); rerr == nil {
			if s := strings.TrimSpace(string(b)); s != "" {
				return s
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			break
		}
		dir = parent
	}
	return "127.0.0.1:9092"
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
