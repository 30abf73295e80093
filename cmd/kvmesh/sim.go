package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/config"
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
	if opts.cfg.Credentials, err = simCredentials(); err != nil {
		return err
	}
	if opts.cfg.HTTPClient, err = simHTTPClient(); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: opts.logLevel}))
	opts.cfg.Log = logger
	var tel service.Telemetry
	if err := config.Load(&tel, os.LookupEnv); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	shutdown, err := telemetry.Setup(ctx, telemetry.Options{
		ServiceName: "kvmesh-sim", Logger: logger,
		OTLPEndpoint: tel.OTLPEndpoint, OTLPTracesEndpoint: tel.OTLPTracesEndpoint,
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
	if len(opts.more) > 0 {
		rep, err := sim.RunFleet(ctx, append([]sim.Config{opts.cfg}, opts.more...))
		bar.done()
		return fleetOutcome(rep, err, opts.json)
	}
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
		return fmt.Errorf("%w: %d of %d requests failed (%d because a rank died), %d blocks mismatched, %d not verified, %d stored values wrong, %d dead ranks, ledger %s",
			errSimFailed, rep.Requests.Failed, rep.Requests.Total, rep.Requests.FailedDeadRank, rep.Verification.Mismatched, rep.Verification.RankUnavailable,
			wrong, len(rep.DeadRanks), map[bool]string{true: "balanced", false: "not balanced"}[rep.Ledger.Balanced])
	}
	return nil
}

// fleetOutcome prints a mixed fleet's report and fails unless every
// model's run is OK.
func fleetOutcome(rep *sim.FleetReport, err error, asJSON bool) error {
	if rep != nil {
		var werr error
		if asJSON {
			werr = writeValue(os.Stdout, rep)
		} else {
			werr = rep.WriteText(os.Stdout)
		}
		if err == nil {
			err = werr
		}
	}
	if err != nil {
		return err
	}
	if !rep.OK {
		var bad []string
		for _, r := range rep.Models {
			if !r.OK {
				bad = append(bad, r.Model)
			}
		}
		return fmt.Errorf("%w: the runs of %s are not clean (see their reports)", errSimFailed, strings.Join(bad, ", "))
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
	// more are the runs of the other models of a mixed fleet (-also),
	// played at once with cfg.
	more []sim.Config
}

// simValues holds the flags a preset supplies defaults for; they apply only
// when given on the command line.
type simValues struct {
	preset, model, turns, system, user, output, brokers, level string
	workers, prefillWorkers, engineIDs, prefillIDs             string
	lookups, schedulers, senders                               string
	requests, sysPrompts, pool, batch, running, watermark      int
	engines, tenants                                           int
	tenantPrefix                                               string
	parallel                                                   service.ParallelOverride
	rate                                                       float64
	think, reqTimeout, settle, rankTimeout                     time.Duration
	seed                                                       uint64
	pd, fresh, reusePreempted                                  bool
	// also are the -also engines of other models: MODEL=URL[,URL…].
	also []string
}

// simFlags reads the command line: a preset gives every default, explicit
// flags override it, and addresses default to the environment and to
// scripts/stack.sh's ports.
func simFlags(args []string) (*simOptions, error) {
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o simOptions
	var v simValues
	// The store check's URL and TLS settings default to the services'
	// variables, read through the struct the services embed.
	var store service.Store
	if err := config.Overlay(&store, os.LookupEnv); err != nil {
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	o.cfg.RedisURL, o.cfg.RedisTLS = store.RedisURL, store.RedisTLS
	brokers, err := defaultBrokers()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	defineWorkloadFlags(fs, &v)
	defineMeshFlags(fs, &o, &v, brokers)
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
	fs.IntVar(&v.parallel.TP, "tp", 0, "tensor-parallel size over the model's parallel.tp; must be the services' KVMESH_TP (default: the model's)")
	fs.IntVar(&v.parallel.PCP, "pcp", 0, "prefill context-parallel size over the model's; must be the services' KVMESH_PCP (default: the model's)")
	fs.IntVar(&v.parallel.DCP, "dcp", 0, "decode context-parallel size over the model's; must be the services' KVMESH_DCP (default: the model's)")
	fs.IntVar(&v.parallel.PP, "pp", 0, "pipeline-parallel size over the model's; must be the services' KVMESH_PP (default: the model's)")
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
	fs.IntVar(&v.tenants, "tenants", 0, "tenants the conversations belong to, round robin (conversation i to tenant i mod N); each request sends its tenant in its lookup and admitted event, so tenants share no store keys; 0 or 1: no tenant")
	fs.StringVar(&v.tenantPrefix, "tenant-prefix", "", "tenant names with -tenants: the prefix and the tenant's index, e.g. tenant-0 (default "+sim.DefaultTenantPrefix+")")
	fs.IntVar(&v.pool, "pool-blocks", 0, "KV blocks per group per engine (capped at the gpuworker's KVMESH_POOL_BLOCKS)")
	fs.IntVar(&v.batch, "max-batch-tokens", 0, "token budget of one engine step (chunked prefill)")
	fs.IntVar(&v.running, "max-running", 0, "most requests running at once per engine")
	fs.IntVar(&v.watermark, "watermark", 0, "free blocks per group admission keeps for running requests")
	fs.BoolVar(&v.reusePreempted, "reuse-preempted", false, "free a preempted request's blocks at once, even while saves of them are in flight, as vLLM does (default: the preset's; on for seed)")
}

// defineMeshFlags defines the addresses and the run's own settings.
func defineMeshFlags(fs *flag.FlagSet, o *simOptions, v *simValues, brokers string) {
	urls := envURLs()
	fs.StringVar(&v.lookups, "lookup", urls.Lookup, "lookup service base URL, or its replicas' comma-separated (a lookup a replica answers with a 5xx or not at all goes to the next) (env KVMESH_LOOKUP_URL)")
	fs.StringVar(&v.schedulers, "scheduler", urls.Scheduler, "scheduler base URL, or its replicas' comma-separated, asked after the run whether every tracker is done; empty skips the check (env KVMESH_SCHEDULER_URL)")
	fs.StringVar(&o.cfg.RedisURL, "redis", o.cfg.RedisURL, "the store pool's Redis URL, read after the run to check every value the run's saves stored; empty skips the check (env KVMESH_REDIS_URL)")
	fs.StringVar(&o.cfg.RedisTLS.CAFile, "redis-ca-file", o.cfg.RedisTLS.CAFile, "PEM CA bundle that verifies the store pool's certificate with a rediss:// -redis URL (default: the system roots) (env KVMESH_REDIS_CA_FILE)")
	fs.StringVar(&o.cfg.RedisTLS.CertFile, "redis-cert-file", o.cfg.RedisTLS.CertFile, "PEM client certificate presented to the store pool, with -redis-key-file (env KVMESH_REDIS_CERT_FILE)")
	fs.StringVar(&o.cfg.RedisTLS.KeyFile, "redis-key-file", o.cfg.RedisTLS.KeyFile, "PEM private key of -redis-cert-file (env KVMESH_REDIS_KEY_FILE)")
	fs.StringVar(&o.cfg.RedisTLS.ServerName, "redis-server-name", o.cfg.RedisTLS.ServerName, "name checked against the store pool's certificate instead of the -redis URL's host (env KVMESH_REDIS_SERVER_NAME)")
	fs.StringVar(&v.senders, "sender", urls.Sender, "sender base URL, or its replicas' comma-separated, asked after the run for its dead letters; empty skips the check (env KVMESH_SENDER_URL)")
	fs.IntVar(&v.engines, "engines", 1, "decode engines in the fleet, each with its own gpuworkers, one per rank (and, with -pd, its own prefill engine and gpuworkers); conversations are spread over them round robin")
	fs.StringVar(&v.workers, "worker", urls.Worker, "the decode engines' gpuworker base URLs, comma-separated: N×W of them for -engines N of W ranks each (W = tp × pcp × pp), engine by engine, each engine's ranks in worker-rank order (as kvmesh model --ranks lists them); or one URL standing for scripts/stack.sh's layout, decode engine i's rank k at its port + 2·i·W + k (env KVMESH_WORKER_URL)")
	fs.StringVar(&v.prefillWorkers, "prefill-worker", urls.PrefillWorker, "the prefill engines' gpuworker base URLs with -pd: N×W comma-separated as -worker, or one URL, prefill engine i's rank k at its port + 2·i·W + k; default: stack.sh's layout from -worker's first URL, prefill engine i's rank k at its port + (2i+1)·W + k (W=1: decode-i :8084+2i, prefill-i :8085+2i) (env KVMESH_PREFILL_WORKER_URL)")
	fs.StringVar(&v.engineIDs, "engine", "", "the decode engines' ids, comma-separated, one per engine (default: each worker's)")
	fs.StringVar(&v.prefillIDs, "prefill-engine", "", "the prefill engines' ids, comma-separated (default: each prefill worker's)")
	fs.StringVar(&v.brokers, "brokers", brokers, "Kafka bootstrap brokers, comma-separated (env KVMESH_KAFKA_BROKERS, else .dev/broker.addr); TLS and SASL come from the services' KVMESH_KAFKA_TLS, KVMESH_KAFKA_*_FILE, KVMESH_KAFKA_SERVER_NAME and KVMESH_KAFKA_SASL_* variables")
	fs.StringVar(&o.cfg.RunTag, "run-tag", "", "prefix of every request id (default a random sim-xxxxxx)")
	fs.BoolVar(&v.fresh, "fresh", true, "salt the block hashes with the run tag, so the run starts with a cold store; false shares store keys with earlier runs of the same workload")
	fs.DurationVar(&v.reqTimeout, "request-timeout", time.Minute, "longest wait for a finished_recving or finished_sending, for blocks at the head of the queue, and for a failing lookup, broker or gpuworker to come back")
	fs.DurationVar(&v.settle, "settle-timeout", 30*time.Second, "longest wait for the last save results after the last request")
	fs.DurationVar(&v.rankTimeout, "rank-timeout", 0, "how long a gpuworker may stay unreachable before its rank is dead for the rest of the run (its engine's requests then fail, naming it); default: -request-timeout")
	fs.StringVar(&o.cfg.KVMemory, "kv-memory", "", "how computed KV reaches the gpuworkers: shm (a shared-memory segment per rank the engine owns, registered with its gpuworker, written in place), http (the data plane's write route); default shm for gpuworkers on this host that accept the registration, http for the others")
	fs.Func("also", "play an engine of another model at once, of the same workload and salt: MODEL=URL[,URL…], the model's preset or spec file (one of the services' KVMESH_MODELS) and its gpuworkers' base URLs, one per worker rank in kvmesh model --ranks order; repeat for more models. The report is then the fleet's: a line per model, then each model's report", func(s string) error {
		v.also = append(v.also, s)
		return nil
	})
	fs.BoolVar(&o.json, "json", false, "print the report as JSON")
	fs.StringVar(&o.progress, "progress", "auto", "progress on stderr: auto (a bar on a terminal, log lines otherwise), bar, log, off")
	fs.StringVar(&v.level, "log-level", "warn", "log level on stderr: debug, info, warn, error")
}

// applyPreset starts from the preset and applies the flags given.
func applyPreset(fs *flag.FlagSet, o *simOptions, v *simValues) error {
	p, ok := sim.LookupPreset(v.preset)
	if !ok {
		return fmt.Errorf("%w: unknown preset %q (have %s)", errUsage, v.preset, presetList())
	}
	o.cfg.Workload, o.cfg.Engine, o.cfg.PD, o.cfg.ReusePreempted = p.Workload, p.Engine, p.PD, p.ReusePreempted
	if v.model == "" {
		v.model = p.Model
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
		"tenants":          func() error { w.Tenants = v.tenants; return nil },
		"tenant-prefix":    func() error { w.TenantPrefix = v.tenantPrefix; return nil },
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

// finishOptions resolves the model and its parallel layout, the log
// level, the fleet, the brokers and their TLS and SASL security (the
// services' KVMESH_KAFKA_* variables), and the run tag and salt.
func finishOptions(o *simOptions, v *simValues) error {
	m, err := service.LoadModel(v.model)
	if err != nil {
		return fmt.Errorf("%w: -model: %w", errUsage, err)
	}
	if err := v.parallel.Apply(m); err != nil {
		return fmt.Errorf("%w: -tp/-pcp/-dcp/-pp: %w", errUsage, err)
	}
	if err := o.logLevel.UnmarshalText([]byte(v.level)); err != nil {
		return fmt.Errorf("%w: -log-level: %w", errUsage, err)
	}
	switch o.progress {
	case "auto", "bar", "log", "off":
	default:
		return fmt.Errorf("%w: -progress %q: want auto, bar, log or off", errUsage, o.progress)
	}
	if o.cfg.Fleet, err = simFleet(v, o.cfg.PD, m.WorldSize()); err != nil {
		return err
	}
	o.cfg.Model, o.cfg.Brokers = m, splitList(v.brokers)
	if o.cfg.Kafka, err = bus.LoadSecurity(os.LookupEnv); err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	o.cfg.LookupURLs, o.cfg.SchedulerURLs, o.cfg.SenderURLs = splitList(v.lookups), splitList(v.schedulers), splitList(v.senders)
	o.cfg.RequestTimeout, o.cfg.SettleTimeout, o.cfg.RankTimeout = v.reqTimeout, v.settle, v.rankTimeout
	if o.cfg.RunTag == "" {
		o.cfg.RunTag = sim.NewRunTag()
	}
	if v.fresh {
		o.cfg.Salt = o.cfg.RunTag
	}
	return alsoModels(o, v)
}

// alsoModels builds the run of each -also engine: the main run's settings
// and workload with the model and gpuworkers it names, its own run tag
// and the main run's salt (the same prompts hash alike in every model).
func alsoModels(o *simOptions, v *simValues) error {
	if len(v.also) > 0 && o.cfg.PD {
		return fmt.Errorf("%w: -also plays decode engines only; drop -pd", errUsage)
	}
	for i, spec := range v.also {
		name, list, ok := strings.Cut(spec, "=")
		if !ok || name == "" || list == "" {
			return fmt.Errorf("%w: -also %q: want MODEL=URL[,URL…]", errUsage, spec)
		}
		m, err := service.LoadModel(name)
		if err != nil {
			return fmt.Errorf("%w: -also %q: %w", errUsage, spec, err)
		}
		urls := splitList(list)
		if len(urls) != m.WorldSize() {
			return fmt.Errorf("%w: -also %q: %d gpuworker URLs for the model's %d worker ranks (%s)", errUsage, spec, len(urls), m.WorldSize(), sim.LayoutText(m))
		}
		cfg := o.cfg
		cfg.Model, cfg.Fleet = m, []sim.Pair{{Decode: sim.Endpoint{WorkerURLs: urls}}}
		cfg.RunTag = fmt.Sprintf("%s-m%d", o.cfg.RunTag, i+1)
		cfg.Progress = nil
		o.more = append(o.more, cfg)
	}
	return nil
}

func presetList() string {
	var out []string
	for _, name := range sim.PresetNames() {
		p, _ := sim.LookupPreset(name)
		out = append(out, fmt.Sprintf("%s (%s)", name, p.Summary))
	}
	return strings.Join(out, "; ")
}

// simFleet builds the fleet of -engines N pairs of engines of world ranks
// each from the worker URLs and engine ids. A list of N×world URLs names
// every rank's worker, engine by engine, each engine's ranks in
// Model.WorkerRanks order. A single URL stands for scripts/stack.sh's
// layout: decode engine i's rank k at its port + 2·i·world + k. The prefill
// engines' workers come from -prefill-worker the same way, or, when it is
// not given, from -worker's first URL: prefill engine i's rank k at its
// port + (2i+1)·world + k (with one rank decode-0 :8084, prefill-0 :8085,
// decode-1 :8086, …; with eight decode-0 :8084-:8091, prefill-0
// :8092-:8099). Engine ids, when given, are N, one per engine.
func simFleet(v *simValues, pd bool, world int) ([]sim.Pair, error) {
	n := v.engines
	if n < 1 {
		return nil, fmt.Errorf("%w: -engines %d: want at least 1", errUsage, n)
	}
	decode, err := rankURLs("worker", v.workers, n, world)
	if err != nil {
		return nil, err
	}
	ids, err := fleetIDs("engine", v.engineIDs, n)
	if err != nil {
		return nil, err
	}
	var prefill [][]string
	var prefillIDs []string
	if pd {
		if prefill, err = prefillURLs(v, n, world); err != nil {
			return nil, err
		}
		if prefillIDs, err = fleetIDs("prefill-engine", v.prefillIDs, n); err != nil {
			return nil, err
		}
	}
	fleet := make([]sim.Pair, n)
	for i := range fleet {
		fleet[i].Decode = sim.Endpoint{EngineID: ids[i], WorkerURLs: decode[i]}
		if pd {
			fleet[i].Prefill = sim.Endpoint{EngineID: prefillIDs[i], WorkerURLs: prefill[i]}
		}
	}
	return fleet, nil
}

// prefillURLs are the prefill engines' worker URLs: -prefill-worker's, or
// stack.sh's layout after -worker's first URL.
func prefillURLs(v *simValues, n, world int) ([][]string, error) {
	if v.prefillWorkers != "" {
		return rankURLs("prefill-worker", v.prefillWorkers, n, world)
	}
	urls := splitList(v.workers)
	if len(urls) == 0 {
		return nil, fmt.Errorf("%w: -worker: no URL to derive the prefill engines' workers from", errUsage)
	}
	return layoutURLs("worker", urls[0], n, world, 1)
}

// rankURLs reads flag name's comma-separated URLs for n engines of world
// ranks each: n×world URLs, engine-major, or one URL standing for
// stack.sh's layout, engine i's rank k at its port + 2·i·world + k.
func rankURLs(name, list string, n, world int) ([][]string, error) {
	urls := splitList(list)
	switch {
	case len(urls) == n*world:
		out := make([][]string, n)
		for i := range out {
			out[i] = urls[i*world : (i+1)*world]
		}
		return out, nil
	case len(urls) != 1:
		return nil, fmt.Errorf("%w: -%s lists %d URLs for %d engines of %d ranks: want %d (engine by engine, ranks in worker-rank order), or one (stack.sh's layout)",
			errUsage, name, len(urls), n, world, n*world)
	}
	return layoutURLs(name, urls[0], n, world, 0)
}

// layoutURLs lays n engines of world ranks out after anchor as stack.sh
// does: engine i's rank k at its port + (2i+slot)·world + k.
func layoutURLs(name, anchor string, n, world, slot int) ([][]string, error) {
	out := make([][]string, n)
	for i := range out {
		for k := range world {
			u, err := shiftPort(anchor, (2*i+slot)*world+k)
			if err != nil {
				return nil, fmt.Errorf("%w: -%s: %w", errUsage, name, err)
			}
			out[i] = append(out[i], u)
		}
	}
	return out, nil
}

// fleetIDs reads the comma-separated engine ids of flag name for n
// engines: none (each worker's own) or n.
func fleetIDs(name, list string, n int) ([]string, error) {
	ids := splitList(list)
	switch len(ids) {
	case 0:
		return make([]string, n), nil
	case n:
		return ids, nil
	}
	return nil, fmt.Errorf("%w: -%s lists %d ids for %d engines", errUsage, name, len(ids), n)
}

// shiftPort returns base with its port raised by delta.
func shiftPort(base string, delta int) (string, error) {
	if delta == 0 {
		return base, nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return "", fmt.Errorf("URL %q: %w", base, err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		return "", fmt.Errorf("URL %q has no port to derive the other engines' and ranks' workers from: list one URL per engine and rank", base)
	}
	u.Host = net.JoinHostPort(u.Hostname(), strconv.Itoa(port+delta))
	return u.String(), nil
}

// defaultBrokers is KVMESH_KAFKA_BROKERS (read through
// service.KafkaBrokers, as the services read it), else the address
// scripts/stack.sh wrote to .dev/broker.addr (searched from the working
// directory up), else the services' default broker address.
func defaultBrokers() (string, error) {
	b := config.Defaults[service.KafkaBrokers]()
	if addr := stackBrokerAddr(); addr != "" {
		b.Brokers = []string{addr}
	}
	if err := config.Overlay(&b, os.LookupEnv); err != nil {
		return "", fmt.Errorf("brokers: %w", err)
	}
	return strings.Join(b.Brokers, ","), nil
}

// stackBrokerAddr is the content of .dev/broker.addr, searched from the
// working directory up; empty when there is none.
func stackBrokerAddr() string {
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
	return ""
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
