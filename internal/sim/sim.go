// Package sim is kvmesh's engine simulator: it plays a fleet of inference
// engines against the real mesh: one or more decode engines, each with its
// own gpuworkers and, in a 1P1D run, its own prefill engine (and that
// engine's gpuworkers), with the workload's conversations spread over them
// round robin. An engine runs one gpuworker per worker rank of the model's
// parallel layout (kvcore.Model.WorkerRanks), as vLLM runs one worker
// process per rank. Each engine has vLLM's shape: a block manager over a
// small pool with prefix caching, per-step scheduling with chunked prefill,
// and preemption under pressure. For every request it hashes the tokens,
// asks the lookup service, allocates, publishes one engine step record per
// step (contract.EngineStep: the step's request events, each with its
// request's trace context), "computes" the KV it does not load by writing
// deterministic bytes into every rank's gpuworker (each rank the bytes of
// its own store namespace), waits for finished_recving before computing
// past a load, checks every loaded block byte for byte on every rank, and
// frees its blocks on finished_sending. A save ledger built from the save
// tasks, the transfer results and the engines' own expectations shows that
// no save was lost; with a store URL, every value the run's saves stored is
// read back from the store and checked against the content its key implies.
//
// Every bounded wait is in time, not in steps: a call to the lookup, the
// brokers or a gpuworker that fails is retried with backoff (50 ms doubling
// to 1 s) for up to the request timeout, so an outage of any service, the
// broker, PostgreSQL or Redis shorter than that (a restart) fails no
// request. Blocks a restarted gpuworker no longer holds are lost KV: they
// are recomputed, not counted as mismatches. (With Config.KVMemory shm the
// KV lives in the engine's own segments and survives a worker restart: the
// engine registers the segment with the new worker process.) A gpuworker that stays
// unreachable for the rank timeout is a dead rank: its engine cannot
// compute any more (every forward pass needs every rank), so each of its
// requests that needs the data path from then on fails with a reason
// naming the rank, its loaded blocks are never counted as verified, and
// the report says which rank died and how many requests it failed.
//
// With ReusePreempted (the seed preset) an engine frees a preempted
// request's blocks at once, as vLLM does, even while saves of them are in
// flight, so other requests reuse them while the sender may still read
// them; the mesh must then dead-letter such a save (block_not_held) or
// store it from the right bytes, which the stored-value check verifies.
package sim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// tracerName names the simulator's spans.
const tracerName = "kvmesh/sim"

// Pair is one decode engine and, in a 1P1D run, its prefill partner, each
// with gpuworkers of its own.
type Pair struct {
	// Decode is the decode engine (the only engine of the pair without PD).
	Decode Endpoint `json:"decode"`
	// Prefill is the prefill engine whose prompts Decode pulls, with PD.
	Prefill Endpoint `json:"prefill"`
}

// Endpoint is one engine and its gpuworkers, one per worker rank.
type Endpoint struct {
	// EngineID is the engine id the gpuworkers were started with; empty
	// takes the workers' (GET /v1/pool).
	EngineID string `json:"engine_id"`
	// WorkerURL is the gpuworker's base URL of a single-rank engine (the
	// same as a one-element WorkerURLs).
	WorkerURL string `json:"worker_url,omitempty"`
	// WorkerURLs are the base URLs of the engine's gpuworkers, one per
	// worker rank, in kvcore.Model.WorkerRanks order; it takes precedence
	// over WorkerURL.
	WorkerURLs []string `json:"worker_urls,omitempty"`
}

// URLs lists the engine's gpuworker base URLs, one per worker rank:
// WorkerURLs, else WorkerURL alone, else none.
func (ep Endpoint) URLs() []string {
	switch {
	case len(ep.WorkerURLs) > 0:
		return ep.WorkerURLs
	case ep.WorkerURL != "":
		return []string{ep.WorkerURL}
	}
	return nil
}

// empty reports an endpoint with nothing set.
func (ep Endpoint) empty() bool { return ep.EngineID == "" && len(ep.URLs()) == 0 }

// Config configures one simulation run.
type Config struct {
	// Model is the served model (the services' KVMESH_MODEL).
	Model *kvcore.Model
	// Workload is what the engines are asked.
	Workload Workload
	// Engine sizes every engine.
	Engine EngineConfig
	// PD runs 1P1D: each decode engine's prefill engine computes its
	// prompts, and the decode engine pulls them through the pd connector
	// and decodes. The lookup's chain must include pd.
	PD bool
	// Decode is the (decode) engine; Prefill the prefill engine with PD. They
	// are the one pair of a run without Fleet.
	Decode, Prefill Endpoint
	// Fleet, when set, lists every engine pair of the run (Decode, and
	// Prefill with PD, must then be empty): one decode engine per pair, with its
	// prefill engine with PD, every engine with gpuworkers of its own (one
	// per worker rank, Endpoint.WorkerURLs). The
	// workload's conversations are spread over the pairs round robin
	// (EngineFor), every turn of a conversation on the same pair. Run
	// fills in the engine ids it took from the workers.
	Fleet []Pair
	// LookupURL is the lookup service's base URL, or the comma-separated
	// base URLs of its replicas; LookupURLs adds more. A lookup that a
	// replica answers with a 5xx or not at all goes to the next replica at
	// once; when every replica fails it is retried with backoff.
	LookupURL  string
	LookupURLs []string
	// SchedulerURL (one URL or a comma-separated list), with SchedulerURLs,
	// are the scheduler's replicas; when there are any, one is asked after
	// the run for the run's trackers: each must be done with no task
	// outstanding. A replica that answers 5xx or not at all is passed over.
	SchedulerURL  string
	SchedulerURLs []string
	// SenderURL (one URL or a comma-separated list), with SenderURLs, are
	// the sender's replicas; when there are any, one is asked after the run
	// for its dead letters: every dead-lettered save of the run must be
	// listed. A replica that answers 5xx or not at all is passed over.
	SenderURL  string
	SenderURLs []string
	// RedisURL, when set, is the store pool (the services' KVMESH_REDIS_URL):
	// after the run every key the run's saves stored (the sender's
	// BlockStored events) is read back and its value checked against the
	// content the key implies.
	RedisURL string
	// RedisTLS are the CA bundle, client certificate and server name of a
	// rediss:// RedisURL (the services' KVMESH_REDIS_CA_FILE, ...).
	RedisTLS kvstore.RedisTLS
	// ReusePreempted frees a preempted request's blocks at once, even while
	// saves of them are in flight (as vLLM does), instead of pinning them
	// until the sender reports the saves.
	ReusePreempted bool
	// WorkerRestarts says the run kills and restarts gpuworkers. A save
	// whose put to a worker that was down through every retry came back
	// with keys failed for put_failed is then accounted (the worker lost
	// those blocks with its pool) instead of a ledger difference; the
	// sender must have dead-lettered it, listed in its DLQ.
	WorkerRestarts bool
	// Brokers are the Kafka bootstrap brokers.
	Brokers []string
	// Kafka is the TLS and SASL security of the simulator's Kafka
	// connections (its producer and its topic readers), as the services'
	// KVMESH_KAFKA_* settings give it; the zero value is plaintext.
	Kafka bus.Security
	// RunTag prefixes every request id; default a random "sim-xxxxxx".
	RunTag string
	// Salt is mixed into every block hash (as vLLM's cache_salt is): runs
	// with different salts share no store keys. Empty shares the store with
	// every unsalted run of the same workload.
	Salt string
	// RequestTimeout is the longest wait for a finished_recving or
	// finished_sending, for blocks at the head of the queue, and for a
	// failing lookup, publish, gpuworker call or topic read to recover;
	// default 60 s.
	RequestTimeout time.Duration
	// RankTimeout is how long a gpuworker may stay unreachable (every call
	// to it failing) before its rank is dead for the rest of the run;
	// default RequestTimeout. An outage shorter than it (a restart) is
	// ridden out.
	RankTimeout time.Duration
	// SettleTimeout bounds the wait for the last save results once every
	// request finished; default 30 s.
	SettleTimeout time.Duration
	// Progress, when set, receives a snapshot every ProgressEvery (default 1 s).
	Progress      func(Progress)
	ProgressEvery time.Duration
	// Log receives warnings; default discards.
	Log *slog.Logger
	// KVMemory is how computed KV reaches the gpuworkers: KVMemoryShm (a
	// shared-memory segment per rank, owned by the engine and registered
	// with its gpuworker), KVMemoryHTTP (the data plane's write route), or
	// KVMemoryAuto (the default: shm for local gpuworkers that accept the
	// registration, http for the others).
	KVMemory string
	// HTTPClient talks to lookup and the gpuworkers; default one with trace
	// propagation.
	HTTPClient *http.Client
	ownClient  bool // HTTPClient was made here; Run closes its connections
	// Credentials, when set, are presented on every call to the mesh
	// (engine tokens per engine, the operator token for admin reads).
	Credentials *Credentials

	// The replicas of each service, from the URL fields.
	lookups, schedulers, senders []string
}

func (c *Config) defaults() error {
	switch {
	case c.Model == nil:
		return fmt.Errorf("no model: %w", ErrConfig)
	case len(c.Fleet) > 0 && (!c.Decode.empty() || c.PD && !c.Prefill.empty()):
		return fmt.Errorf("set Fleet or Decode and Prefill, not both: %w", ErrConfig)
	case len(replicaURLs(c.LookupURL, c.LookupURLs)) == 0:
		return fmt.Errorf("the lookup URL is required: %w", ErrConfig)
	case len(c.Brokers) == 0:
		return fmt.Errorf("no brokers: %w", ErrConfig)
	case c.Engine.MaxBatchTokens < 1 || c.Engine.MaxRunning < 1 || c.Engine.PoolBlocks < 0 || c.Engine.Watermark < 0:
		return fmt.Errorf("engine %+v: %w", c.Engine, ErrConfig)
	}
	if err := c.Kafka.Validate(); err != nil {
		return fmt.Errorf("kafka security: %w: %w", err, ErrConfig)
	}
	c.lookups = replicaURLs(c.LookupURL, c.LookupURLs)
	c.schedulers = replicaURLs(c.SchedulerURL, c.SchedulerURLs)
	c.senders = replicaURLs(c.SenderURL, c.SenderURLs)
	if len(c.Fleet) == 0 {
		c.Fleet = []Pair{{Decode: c.Decode, Prefill: c.Prefill}}
	}
	c.Fleet = slices.Clone(c.Fleet) // workers fills in engine ids: not in the caller's array
	if err := c.checkFleetURLs(); err != nil {
		return err
	}
	if c.RunTag == "" {
		c.RunTag = NewRunTag()
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = 60 * time.Second
	}
	if c.RankTimeout <= 0 {
		c.RankTimeout = c.RequestTimeout
	}
	if c.SettleTimeout <= 0 {
		c.SettleTimeout = 30 * time.Second
	}
	if c.ProgressEvery <= 0 {
		c.ProgressEvery = time.Second
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.HTTPClient == nil {
		c.HTTPClient = dataplane.DefaultHTTPClient()
		c.HTTPClient.Timeout = 30 * time.Second
		c.ownClient = true
	}
	c.HTTPClient = withCredentials(c.HTTPClient, c.Credentials)
	if err := checkKVMemory(c.KVMemory); err != nil {
		return err
	}
	return c.Workload.Validate()
}

// NewRunTag returns a random run tag, "sim-" and six hex digits.
func NewRunTag() string {
	var b [3]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return "sim-" + hex.EncodeToString(b[:])
}

// run is one simulation in progress.
type run struct {
	cfg     Config
	convs   []*Conversation
	stats   *stats
	ledger  *ledger
	engines map[string]*engine
	pairs   []*pair
	ctx     context.Context
	start   time.Time // when the engines started

	// stored is the stored-value check, made at the end of play while the
	// kvmesh.kv.events reader still runs (nil without cfg.RedisURL or when
	// the run did not settle).
	stored *StoreCheck

	mu      sync.Mutex
	turns   int
	left    int
	allDone chan struct{}
}

// pair is one decode engine and the engine that receives its turns: its
// prefill engine with PD, else the decode engine itself.
type pair struct {
	front  *engine // receives new turns
	decode *engine // generates the replies
}

// EngineFor is the engine pair (an index into the fleet of engines
// engines) that serves conversation conv: round robin over the
// conversations, so that every turn of a conversation reaches the engine
// that holds its earlier turns (session affinity) and shared prefixes
// spread over every engine.
func EngineFor(conv, engines int) int {
	if engines < 1 || conv < 0 {
		return 0
	}
	return conv % engines
}

// Run plays the workload against the mesh and returns the report. It
// returns an error only when the run could not be carried out (bad config,
// a gpuworker unreachable or of another layout at the start, a broker that
// stays unreachable); failed requests, mismatches, dead ranks (a gpuworker
// that stayed unreachable mid-run) and an unbalanced ledger are in the
// report (Report.OK).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if cfg.ownClient {
		defer cfg.HTTPClient.CloseIdleConnections()
	}
	convs, err := Generate(cfg.Workload)
	if err != nil {
		return nil, err
	}
	if err := cfg.workers(ctx); err != nil {
		return nil, err
	}
	cfg.warnUnfit(convs)
	pub, err := bus.NewProducer(cfg.Brokers, bus.WithSecurity(cfg.Kafka))
	if err != nil {
		return nil, fmt.Errorf("producer: %w", err)
	}
	defer pub.Close()
	from, err := startOffsets(ctx, cfg.Brokers, cfg.Kafka)
	if err != nil {
		return nil, err
	}
	r := &run{cfg: cfg, convs: convs, stats: newStats(), ledger: newLedger(cfg.Model, cfg.RunTag+"-", cfg.WorkerRestarts),
		engines: map[string]*engine{}, allDone: make(chan struct{})}
	r.ledger.tenants = r.requestTenants()
	r.build(pub)
	detach, err := r.attachMemory(ctx)
	if err != nil {
		return nil, err
	}
	defer detach()
	r.scrapeRanks(ctx, true)
	r.start = time.Now()
	if err := r.play(ctx, from); err != nil {
		return nil, err
	}
	elapsed := time.Since(r.start)
	r.scrapeRanks(ctx, false)
	rep := r.report(elapsed)
	r.check(ctx, rep)
	return rep, nil
}

// warnUnfit logs a warning when the workload's longest request cannot fit
// an engine's pool (it would fail as not admitted): the gpuworkers'
// KVMESH_POOL_BLOCKS, or the engine's PoolBlocks, is too small for it.
func (c *Config) warnUnfit(convs []*Conversation) {
	longest := 0
	for _, conv := range convs {
		for t, turn := range conv.Turns {
			longest = max(longest, len(conv.Prompt(t))+len(turn.Output))
		}
	}
	for g, grp := range c.Model.Groups {
		if need := ceilDiv(longest, grp.BlockSize) + 1; need > c.Engine.PoolBlocks-c.Engine.Watermark {
			c.Log.Warn("the longest request does not fit the engines' pool: raise the gpuworkers' KVMESH_POOL_BLOCKS (and -pool-blocks)",
				"tokens", longest, "group", g, "blocks_needed", need+c.Engine.Watermark, "pool_blocks", c.Engine.PoolBlocks)
			return
		}
	}
}

// startOffsets records where the topics the simulator reads end now, before
// it publishes anything, so nothing of the run is missed.
func startOffsets(ctx context.Context, brokers []string, sec bus.Security) (map[string]map[int]int64, error) {
	out := map[string]map[int]int64{}
	for _, t := range []string{contract.TopicEngineFeedback, contract.TopicSaveTasks, contract.TopicTransferResults, contract.TopicKVEvents} {
		off, err := topicOffsets(ctx, brokers, sec, t, false)
		if err != nil {
			return nil, err
		}
		out[t] = off
	}
	return out, nil
}

// build creates the engines, pair by pair, and wires them to the driver:
// a decode engine tells its own prefill engine when it read a request's
// blocks.
func (r *run) build(pub *bus.Producer) {
	lookup := newLookupClient(r.cfg.lookups, r.cfg.HTTPClient) // shared: a dead replica is passed over by every engine
	deps := func(ep Endpoint) engineDeps {
		return engineDeps{
			model: r.cfg.Model, runTag: r.cfg.RunTag, ranks: newRankWorkers(r.cfg.Model, ep.URLs(), r.cfg.HTTPClient),
			hc:     r.cfg.HTTPClient,
			lookup: lookup, pub: pub,
			ledger: r.ledger, stats: r.stats, log: r.cfg.Log, timeout: r.cfg.RequestTimeout, rankTimeout: r.cfg.RankTimeout,
			reusePreempted: r.cfg.ReusePreempted,
		}
	}
	for _, ep := range r.cfg.Fleet {
		p := &pair{}
		hooks := engineHooks{generated: r.generated, abandoned: r.generated, finalized: r.finalized, peerRead: func(string) {}}
		role := RoleBoth
		if r.cfg.PD {
			role = RoleDecode
			hooks.peerRead = func(id string) { p.front.box.put(peerReleased{requestID: id}) }
		}
		p.decode = newEngine(ep.Decode.EngineID, role, r.cfg.Engine, deps(ep.Decode), hooks)
		p.front = p.decode
		r.engines[p.decode.id] = p.decode
		if r.cfg.PD {
			ph := engineHooks{generated: r.prefilled, abandoned: r.prefillAbandoned, finalized: r.finalized, peerRead: func(string) {}}
			p.front = newEngine(ep.Prefill.EngineID, RolePrefill, r.cfg.Engine, deps(ep.Prefill), ph)
			r.engines[p.front.id] = p.front
		}
		r.pairs = append(r.pairs, p)
	}
	r.ledger.onSaved = func(engine, request string, rep savedReport) {
		if e := r.engines[engine]; e != nil {
			e.box.put(saveReported{requestID: request, savedReport: rep})
		}
	}
	r.turns = 0
	for _, c := range r.convs {
		r.turns += len(c.Turns)
	}
	r.left = r.turns
	r.stats.requests = r.turns
}

// play runs the engines, the topic readers and the arrivals until every
// turn is finalized and the ledger settled, or ctx ends.
func (r *run) play(parent context.Context, from map[string]map[int]int64) error {
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	r.ctx = ctx
	g, gctx := errgroup.WithContext(ctx)
	brokers, sec, bound := r.cfg.Brokers, r.cfg.Kafka, r.cfg.RequestTimeout
	g.Go(func() error {
		return tailTopic(gctx, brokers, sec, contract.TopicEngineFeedback, from[contract.TopicEngineFeedback], bound, r.routeFeedback)
	})
	g.Go(func() error {
		return tailTopic(gctx, brokers, sec, contract.TopicSaveTasks, from[contract.TopicSaveTasks], bound, r.ledger.saveTask)
	})
	g.Go(func() error {
		return tailTopic(gctx, brokers, sec, contract.TopicTransferResults, from[contract.TopicTransferResults], bound, r.ledger.transferResult)
	})
	g.Go(func() error { // the stored keys, for the per-rank ledger and the stored-value check
		return tailTopic(gctx, brokers, sec, contract.TopicKVEvents, from[contract.TopicKVEvents], bound, r.ledger.kvEvent)
	})
	for _, e := range r.engines {
		g.Go(func() error { return e.run(gctx) })
	}
	if r.cfg.Progress != nil {
		g.Go(func() error { r.progress(gctx); return nil })
	}
	var timers []*time.Timer
	for _, c := range r.convs {
		timers = append(timers, time.AfterFunc(c.Start, func() { r.submitTurn(c, 0) }))
	}
	defer func() {
		for _, t := range timers {
			t.Stop()
		}
	}()
	g.Go(func() error {
		defer cancel()
		select {
		case <-r.allDone:
			if r.settle(gctx) {
				r.checkStore(gctx)
			}
		case <-gctx.Done():
		}
		return nil
	})
	err := g.Wait()
	if err != nil && parent.Err() == nil {
		return err
	}
	return nil
}

// check asks the scheduler and the sender about the run, when configured.
func (r *run) check(ctx context.Context, rep *Report) {
	engines := make([]string, 0, len(r.engines))
	for id := range r.engines {
		engines = append(engines, id)
	}
	prefix := r.cfg.RunTag + "-"
	if len(r.cfg.schedulers) > 0 {
		c := checkTrackers(ctx, r.cfg.HTTPClient, newReplicas(r.cfg.schedulers), engines, prefix, r.turns*len(r.engines)/len(r.pairs))
		rep.Trackers = &c
		rep.OK = rep.OK && c.OK
	}
	if len(r.cfg.senders) > 0 {
		c := checkDLQ(ctx, r.cfg.HTTPClient, newReplicas(r.cfg.senders), engines, prefix, r.ledger.deadLettered())
		rep.DLQ = &c
		rep.OK = rep.OK && c.OK
		checkTenantStores(ctx, r.cfg.HTTPClient, newReplicas(r.cfg.senders), rep.Tenants, time.Duration(rep.ElapsedSeconds*float64(time.Second)))
	}
	if c := r.stored; c != nil {
		c.LedgerStored = rep.Ledger.Stored
		rep.Stored = c
		rep.OK = rep.OK && c.OK
	}
}

// checkStore reads back every value the run stored (checkStored) and then
// waits, up to announceWait, for the BlockRemoved events of the keys it
// found gone: reading the values takes memory, and a store at its
// maxmemory evicts while it answers, so some keys go during the check
// itself and are announced after it.
func (r *run) checkStore(ctx context.Context) {
	keys, announced := r.ledger.storedKeys()
	c := checkStored(ctx, r.cfg, keys, r.ledger.wasRemoved)
	c.Announced = announced
	if len(c.gone) > 0 {
		waitUntil(ctx, time.Now().Add(announceWait), func() bool {
			return !slices.ContainsFunc(c.gone, func(k string) bool { return !r.ledger.wasRemoved(k) })
		})
		c.GoneAnnounced = 0
		for _, k := range c.gone {
			if r.ledger.wasRemoved(k) {
				c.GoneAnnounced++
			}
		}
	}
	r.stored = &c
}

// announceWait bounds the wait for the BlockStored events of stored keys
// once every save is reported (they are published with the results).
const announceWait = 5 * time.Second

// settle waits until every save of the run is published and reported, or
// the settle timeout passes; then, for the stored-value check, a little
// longer for the BlockStored events of the stored keys. It reports whether
// the stored-value check should run: the run settled and a store is
// configured.
func (r *run) settle(ctx context.Context) bool {
	deadline := time.Now().Add(r.cfg.SettleTimeout)
	if !waitUntil(ctx, deadline, func() bool { return r.ledger.outstanding() == 0 }) || r.cfg.RedisURL == "" {
		return false
	}
	if d := time.Now().Add(announceWait); d.Before(deadline) {
		deadline = d
	}
	waitUntil(ctx, deadline, func() bool { return r.ledger.unannounced() == 0 })
	return ctx.Err() == nil
}

// waitUntil polls done every 50 ms until it holds (true), the deadline
// passes or ctx ends (false).
func waitUntil(ctx context.Context, deadline time.Time, done func() bool) bool {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for !done() {
		if !time.Now().Before(deadline) {
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
		}
	}
	return true
}

// routeFeedback hands each message of an engine feedback record to its
// engine, in order.
func (r *run) routeFeedback(rec Record) {
	fs, err := contract.DecodeEngineFeedback(rec.Value)
	if err != nil {
		return
	}
	for _, f := range fs {
		if e := r.engines[f.EngineID]; e != nil {
			e.box.put(f)
		}
	}
}

func (r *run) progress(ctx context.Context) {
	tick := time.NewTicker(r.cfg.ProgressEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			r.cfg.Progress(r.stats.progress())
			return
		case <-tick.C:
			r.cfg.Progress(r.stats.progress())
		}
	}
}

// submitTurn sends turn t of conversation c to the front engine of the
// conversation's pair.
func (r *run) submitTurn(c *Conversation, t int) {
	if r.ctx.Err() != nil {
		return
	}
	p := r.pairs[EngineFor(c.Index, len(r.pairs))]
	ts := &turnState{conv: c, index: t, id: r.turnID(c, t), pair: p, parts: 1, arrived: time.Now()}
	if r.cfg.PD {
		ts.parts = 2
	}
	ts.ctx, ts.span = otel.Tracer(tracerName).Start(r.ctx, "sim.turn", trace.WithAttributes(
		attribute.String(telemetry.AttrRequestID, ts.id), attribute.Int("kvmesh.conversation", c.Index), attribute.Int("kvmesh.turn", t),
	))
	maxOut := len(c.Turns[t].Output)
	if r.cfg.PD {
		maxOut = 1
	}
	req := r.newRequest(ts, p.front, maxOut)
	req.holdForPeer = r.cfg.PD
	p.front.submit(req)
}

// turnID is the request id of turn t of conversation c.
func (r *run) turnID(c *Conversation, t int) string {
	return RequestID(r.cfg.RunTag, c.Index, t)
}

// requestTenants maps every request id of the run to its conversation's
// tenant; nil when no conversation has one.
func (r *run) requestTenants() map[string]string {
	if r.cfg.Workload.Tenants < 2 {
		return nil
	}
	out := map[string]string{}
	for _, c := range r.convs {
		for t := range c.Turns {
			out[r.turnID(c, t)] = c.Tenant
		}
	}
	return out
}

// newRequest starts one engine's request of a turn, in its own span.
func (r *run) newRequest(ts *turnState, e *engine, maxOut int) *request {
	ctx, span := otel.Tracer(tracerName).Start(ts.ctx, "sim.request", trace.WithAttributes(
		attribute.String(telemetry.AttrEngineID, e.id), attribute.String(telemetry.AttrRequestID, ts.id),
		attribute.String("kvmesh.role", string(e.role)),
	))
	turn := ts.conv.Turns[ts.index]
	return &request{salt: []byte(r.cfg.Salt), tenant: ts.conv.Tenant, id: ts.id, engine: e.id, turn: ts, ctx: ctx, span: span, traceparent: traceparent(ctx),
		prompt: ts.conv.Prompt(ts.index), output: turn.Output, maxOut: maxOut}
}

// prefilled hands a request the prefill engine computed to its decode
// engine, with kv_transfer_params naming the prefill engine's blocks.
func (r *run) prefilled(p *request) {
	pr := p.turn.pair
	d := r.newRequest(p.turn, pr.decode, len(p.output))
	d.pd = &contract.PDSource{EngineID: pr.front.id, BlockTable: p.table.Clone(), Tokens: len(p.prompt), NullBlockID: declaredNullBlockID()}
	pr.decode.submit(d)
}

// generated starts the conversation's next turn after the think time.
func (r *run) generated(req *request) {
	c, next := req.turn.conv, req.turn.index+1
	if next < len(c.Turns) {
		time.AfterFunc(r.cfg.Workload.ThinkTime, func() { r.submitTurn(c, next) })
	}
}

// prefillAbandoned books the decode part of a turn whose prefill the
// prefill engine gave up on, and starts the conversation's next turn.
func (r *run) prefillAbandoned(p *request) {
	r.partDone(p.turn, p.turn.pair.decode.id, p.id, "not decoded: the prefill engine gave up on it", p.deadRank)
	r.generated(p)
}

// finalized books an engine request that is over.
func (r *run) finalized(req *request) {
	req.span.End()
	r.partDone(req.turn, req.engine, req.id, req.failure, req.deadRank)
}

// partDone books one engine's part of a turn; deadRank names the
// engine/rank whose death failed it, if one did.
func (r *run) partDone(ts *turnState, engine, id, failure, deadRank string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if failure != "" {
		ts.failed = append(ts.failed, failure)
		r.stats.failure(RequestFailure{EngineID: engine, RequestID: id, Reason: failure, DeadRank: deadRank})
		if ts.deadRank == "" {
			ts.deadRank = deadRank
		}
	}
	r.stats.engine(engine, func(c *EngineCounts) {
		c.Requests++
		if failure != "" {
			c.Failed++
		}
	})
	ts.parts--
	if ts.parts > 0 {
		return
	}
	ts.span.End()
	r.stats.update(func(st *stats) {
		st.done++
		if len(ts.failed) > 0 {
			st.failed++
		}
		if ts.deadRank != "" {
			st.deadTurns[ts.deadRank]++
		}
	})
	r.left--
	if r.left == 0 {
		close(r.allDone)
	}
}
