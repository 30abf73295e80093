// Package e2e runs the whole mesh: the four services as real processes
// (built from ./services/*), the embedded Kafka-protocol broker, a fresh
// PostgreSQL database and the shared Redis under a key prefix of their own,
// driven by the engine simulator (internal/sim).
package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

func TestMain(m *testing.M) {
	// Real trace ids (no exporter), so trace context travels as it does in
	// production and the tests can check it.
	shutdown, err := telemetry.Setup(context.Background(), telemetry.Options{ServiceName: "kvmesh-e2e"})
	if err != nil {
		os.Stderr.WriteString("telemetry: " + err.Error() + "\n")
		os.Exit(1)
	}
	code := m.Run()
	_ = shutdown(context.Background())
	testenv.StopRedisClusters()
	if err := testenv.RemoveBinaries(); err != nil {
		os.Stderr.WriteString("remove test binaries: " + err.Error() + "\n")
	}
	http.DefaultClient.CloseIdleConnections()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreCurrent()); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

const model = "hybrid-mla-linear"

// smallWorkload is a short multi-turn chat workload; with a pool of 48
// blocks per group prefixes are evicted and reloaded, and requests are
// preempted.
func smallWorkload(requests int, rate float64) sim.Workload {
	return sim.Workload{
		Requests: requests, Turns: sim.Range{Min: 2, Max: 4}, SystemPrompts: 2,
		SystemTokens: sim.Range{Min: 64, Max: 192}, UserTokens: sim.Range{Min: 16, Max: 64},
		OutputTokens: sim.Range{Min: 4, Max: 20}, Rate: rate, ThinkTime: 20 * time.Millisecond,
		Seed: 54643, Vocab: 32000,
	}
}

// simConfig points the simulator at the stack.
func simConfig(t testing.TB, s *stack, pd bool, w sim.Workload) sim.Config {
	t.Helper()
	m, err := kvcore.Preset(s.model)
	if err != nil {
		t.Fatal(err)
	}
	tag := sim.NewRunTag()
	return secured(sim.Config{
		Model: m, Workload: w, PD: pd,
		Engine:     sim.EngineConfig{PoolBlocks: 48, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1},
		Decode:     sim.Endpoint{WorkerURL: s.url("gpuworker")},
		Prefill:    sim.Endpoint{WorkerURL: s.url("gpuworker-prefill")},
		LookupURLs: s.urls("lookup"), SchedulerURLs: s.urls("scheduler"), SenderURLs: s.urls("sender"),
		Brokers: s.brokers, RunTag: tag, Salt: tag, RedisURL: s.redisURL, ReusePreempted: true,
		RequestTimeout: 45 * time.Second, SettleTimeout: 30 * time.Second,
		Credentials: s.credentials(),
	}, s.mesh.Secure)
}

// requireStoreLoads replays the workload of first on a fresh engine (empty
// local cache) with first's salt, so that its prompts hash to the keys
// first saved: the replay must be clean and load prefixes from the store,
// whatever the first run's own timing left to its local cache. It returns
// the replay's report.
func requireStoreLoads(ctx context.Context, t *testing.T, s *stack, first sim.Config) *sim.Report {
	t.Helper()
	again := simConfig(t, s, false, first.Workload)
	again.Workload.Requests = min(first.Workload.Requests, 12)
	again.Salt = first.Salt
	rep, err := sim.Run(ctx, again)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if rep.Tokens.Loaded["store"] == 0 {
		t.Fatalf("replay with the first run's salt: loaded tokens %v, want loads from the store", rep.Tokens.Loaded)
	}
	return rep
}

// requireOK fails the test unless the report is clean: every request ok,
// every loaded byte right, every stored value right, the save ledger
// balanced, every tracker done.
func requireOK(t *testing.T, rep *sim.Report) {
	t.Helper()
	var b strings.Builder
	_ = rep.WriteText(&b)
	t.Logf("report:\n%s", b.String())
	if !rep.OK || rep.Requests.Failed != 0 || rep.Requests.OK != rep.Requests.Total ||
		rep.Verification.Mismatched != 0 || !rep.Ledger.Balanced || rep.Trackers == nil || !rep.Trackers.OK ||
		(rep.Stored != nil && (!rep.Stored.OK || rep.Stored.Wrong != 0 || (rep.Stored.Checked == 0 && rep.Ledger.Stored > 0))) {
		b, _ := json.MarshalIndent(rep, "", "  ")
		t.Fatalf("simulation not clean:\n%s", b)
	}
	if rep.Ledger.Stored+rep.Ledger.Existing == 0 {
		t.Fatalf("the run saved nothing: %+v", rep.Ledger)
	}
}

// TestSeedPreset plays the seed's configuration (2-group hybrid, 1P1D with
// the pd,store chain, small pool) and checks the report and every save task
// ever published: none has an empty or short block table.
func TestSeedPreset(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// Eight system prompts do not fit the prefill engine's 48-block pool
	// together, so later turns often find their prefix evicted locally
	// and load it from the store — but how often depends on the run's
	// timing: a fast mesh, or a slow machine, can leave none. The store
	// loads are then required of a replay of the run on fresh engines
	// (requireStoreLoads), which hits the keys this run saved.
	w := smallWorkload(36, 6)
	w.SystemPrompts = 8
	cfg := simConfig(t, s, true, w)
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if rep.Tokens.Loaded["pd"] == 0 {
		t.Fatalf("loaded tokens %v: want pd loads", rep.Tokens.Loaded)
	}
	checkAllSaveTables(ctx, t, s, rep)
	if n := seedDecisions(ctx, t, s); n == 0 {
		t.Fatal("no lookup chose pd while the store child also kept a LoadSpec: the seed's condition was not exercised")
	}
	checkTraceHeaders(ctx, t, s)
	if rep.Tokens.Loaded["store"] == 0 { // last: the checks above read what this run alone published
		t.Logf("loaded tokens %v: no store load this run; replaying it on fresh engines", rep.Tokens.Loaded)
		requireStoreLoads(ctx, t, s, cfg)
	}
}

// checkTraceHeaders: every engine event and lookup decision of one
// request (both engines of a turn) carries the same trace id.
func checkTraceHeaders(ctx context.Context, t *testing.T, s *stack) {
	t.Helper()
	traces := map[string]map[string]bool{}
	for _, topic := range []string{contract.TopicEngineSteps, contract.TopicLookupDecisions} {
		recs, err := sim.ReadAll(ctx, s.brokers, topic)
		if err != nil {
			t.Fatal(err)
		}
		for _, rec := range recs {
			parts := strings.Split(rec.Headers[contract.HeaderTraceparent], "-")
			if len(parts) != 4 || strings.Trim(parts[1], "0") == "" {
				t.Fatalf("%s record of %s has traceparent %q", topic, rec.Key, rec.Headers[contract.HeaderTraceparent])
			}
			if traces[rec.Key] == nil {
				traces[rec.Key] = map[string]bool{}
			}
			traces[rec.Key][parts[1]] = true
		}
	}
	for key, ids := range traces {
		if len(ids) != 1 {
			t.Fatalf("request %s spans %d traces", key, len(ids))
		}
	}
}

// checkAllSaveTables reads every record ever published on kvmesh.save.tasks:
// each decodes, and none has an empty or short block table.
func checkAllSaveTables(ctx context.Context, t *testing.T, s *stack, rep *sim.Report) {
	t.Helper()
	m, _ := kvcore.Preset(model)
	tasks, err := sim.ReadAll(ctx, s.brokers, contract.TopicSaveTasks)
	if err != nil {
		t.Fatal(err)
	}
	if len(tasks) < rep.Ledger.SaveTasks || len(tasks) == 0 {
		t.Fatalf("%d records on %s, the ledger counted %d tasks", len(tasks), contract.TopicSaveTasks, rep.Ledger.SaveTasks)
	}
	for _, rec := range tasks {
		task, err := kvcore.DecodeSaveTask(rec.Value)
		if err != nil {
			t.Fatalf("offset %d/%d: %v", rec.Partition, rec.Offset, err)
		}
		checkTable(t, m, task)
	}
}

// checkTable fails unless the task's table has one list per model group and
// covers every chunk it names.
func checkTable(t *testing.T, m *kvcore.Model, task *kvcore.SaveTask) {
	t.Helper()
	if len(task.BlockTable) != len(m.Groups) {
		t.Fatalf("save %s has a %d-group table for a %d-group model", task.TaskID, len(task.BlockTable), len(m.Groups))
	}
	for _, gc := range task.Groups {
		bs := m.Groups[gc.Group].BlockSize
		for _, c := range gc.Chunks {
			if c.BlockIndex(bs) >= len(task.BlockTable[gc.Group]) || task.BlockTable[gc.Group][c.BlockIndex(bs)] == kvcore.NullBlock {
				t.Fatalf("save %s: group %d chunk [%d,%d) outside its table %v", task.TaskID, gc.Group, c.Start, c.End, task.BlockTable[gc.Group])
			}
		}
	}
}

// seedDecisions counts lookup decisions where pd was chosen while the store
// child kept a LoadSpec: the losing child's spec ends with can_load false,
// which the in-process connector turned into an empty-table save.
func seedDecisions(ctx context.Context, t *testing.T, s *stack) int {
	t.Helper()
	n := 0
	for _, d := range lookupDecisions(ctx, t, s) {
		for _, c := range d.Children {
			if d.Chosen == "pd" && c.Name == "store" && c.Spec != nil {
				n++
			}
		}
	}
	return n
}

// lookupDecisions reads every lookup decision published on the stack's
// broker.
func lookupDecisions(ctx context.Context, t *testing.T, s *stack) []contract.LookupDecision {
	t.Helper()
	recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicLookupDecisions)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]contract.LookupDecision, len(recs))
	for i, rec := range recs {
		if err := json.Unmarshal(rec.Value, &out[i]); err != nil {
			t.Fatalf("lookup decision at %d/%d: %v", rec.Partition, rec.Offset, err)
		}
	}
	return out
}

// TestMalformedSavesDeadLettered injects a save task whose table lacks a
// group and a record of garbage bytes into kvmesh.save.tasks during a run:
// both are dead-lettered with reasons and listed by GET /v1/dlq, the sender
// stays healthy, and the simulation's own saves are all stored.
func TestMalformedSavesDeadLettered(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := simConfig(t, s, false, smallWorkload(24, 8))
	started := make(chan struct{})
	fired := false // only the progress goroutine reads and writes it
	cfg.Progress, cfg.ProgressEvery = func(p sim.Progress) {
		if p.Done > 0 && !fired {
			fired = true
			close(started)
		}
	}, 50*time.Millisecond
	type result struct {
		rep *sim.Report
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := sim.Run(ctx, cfg)
		done <- result{rep, err}
	}()
	select {
	case <-started:
	case r := <-done:
		t.Fatalf("the run ended before it was under way: %v", r.err)
	}
	wrong := injectMalformed(ctx, t, s)
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	requireOK(t, r.rep)
	// The run's own saves are all stored or found present, but for those
	// the engine fails closed on: a save in flight when its request was
	// preempted, whose blocks the engine reused at once (ReusePreempted),
	// is dead-lettered block_not_held — the right outcome, whenever the
	// timing makes it happen.
	l, reuse := r.rep.Ledger, r.rep.Reuse
	notHeld := 0
	if r.rep.DLQ != nil {
		notHeld = r.rep.DLQ.Reasons[string(kvcore.ReasonBlockNotHeld)]
	}
	if l.Skipped != 0 || l.Failed != 0 || l.Stored+l.Existing+l.DeadLettered != l.ExpectedChunks ||
		l.DeadLettered > 0 && (reuse.SavesInFlight == 0 || notHeld == 0 || r.rep.DLQ.Entries != notHeld) {
		t.Fatalf("the run's own saves: %+v, reuse %+v, dead letters %+v; want every key stored or existing, "+
			"but for block_not_held ones of saves in flight at a preemption", l, reuse, r.rep.DLQ)
	}
	checkWrongGroups(ctx, t, s, wrong)
	checkGarbage(ctx, t, s)
	if err := s.alive("sender"); err != nil {
		t.Fatalf("sender after the malformed records: %v", err)
	}
}

const garbageKey = "inject-garbage"

// injectMalformed publishes the seed's crash input (a save whose table has
// one group for the 2-group model) and a record of garbage bytes. It returns
// the malformed task. The task's group-0 blocks (60 and 61: past the
// simulated engine's 48, so its blocks are untouched) are first written with
// their chunks' identities, as the engine would have computed them, so the
// worker can prove what it stores.
func injectMalformed(ctx context.Context, t *testing.T, s *stack) kvcore.SaveTask {
	t.Helper()
	m, _ := kvcore.Preset(model)
	hashes := kvcore.HashChain(make([]uint32, 32), m.HashBlockSize, []byte(sim.NewRunTag()))
	task := kvcore.SaveTask{
		Schema: kvcore.SchemaSaveTask, TaskID: decodeEngine + "/inject-wrong-groups/save/1", EngineID: decodeEngine,
		RequestID: "inject-wrong-groups", Model: m.Name, Start: 0, End: 32,
		BlockTable: kvcore.BlockTable{{60, 61}}, BlockHashes: []string{hashes[0].Hex(), hashes[1].Hex()},
		Groups: m.SaveGroups(0, 32),
	}
	var blocks []dataplane.Block
	for i, b := range task.BlockTable[0] {
		blocks = append(blocks, dataplane.Block{
			BlockRef: dataplane.BlockRef{Group: 0, Block: b},
			Identity: dataplane.Identity{Hash: task.BlockHashes[i], RequestID: task.RequestID},
			Data:     sim.BlockContent(m, 0, kvcore.Rank{}, hashes[i]),
		})
	}
	if err := s.mesh.EngineClient(t, s.url("gpuworker"), decodeEngine).Write(ctx, blocks); err != nil {
		t.Fatal(err)
	}
	value, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	publishSaveTasks(ctx, t, s,
		bus.Message{Key: task.RequestID, Value: value},
		bus.Message{Key: garbageKey, Value: []byte("\x00\xffnot a save task{")},
	)
	return task
}

// publishSaveTasks publishes msgs to kvmesh.save.tasks (it sets their
// Topic) through a producer of its own; a span in ctx travels in their
// trace headers.
func publishSaveTasks(ctx context.Context, t *testing.T, s *stack, msgs ...bus.Message) {
	t.Helper()
	pub, err := bus.NewProducer(s.brokers)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	for i := range msgs {
		msgs[i].Topic = contract.TopicSaveTasks
	}
	if err := pub.Publish(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
}

// dlqEntry is the part of a GET /v1/dlq item the test reads.
type dlqEntry struct {
	Reason    string `json:"reason"`
	Detail    string `json:"detail"`
	Group     *int   `json:"group"`
	TaskID    string `json:"task_id"`
	Topic     string `json:"topic"`
	Partition int    `json:"partition"`
	Offset    int64  `json:"offset"`
}

// dlq lists the sender's dead letters matching q.
func dlq(t *testing.T, s *stack, q url.Values) []dlqEntry {
	t.Helper()
	q.Set("limit", "1000")
	var page struct {
		Items []dlqEntry `json:"items"`
	}
	getJSON(t, s.url("sender")+"/v1/dlq?"+q.Encode(), adminToken, &page)
	return page.Items
}

// eventually polls cond until it holds, failing the test after 30 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if !poll(context.Background(), 30*time.Second, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// checkWrongGroups: group 1 of the malformed task is dead-lettered with
// table_group_count, group 0 is stored, and the result says so.
func checkWrongGroups(ctx context.Context, t *testing.T, s *stack, task kvcore.SaveTask) {
	t.Helper()
	var entries []dlqEntry
	eventually(t, "the malformed save in GET /v1/dlq", func() bool {
		entries = dlq(t, s, url.Values{"request_id": {task.RequestID}})
		return len(entries) > 0
	})
	for _, e := range entries {
		if e.Group == nil || *e.Group != 1 || e.Reason != string(kvcore.ReasonTableGroupCount) || e.TaskID != task.TaskID {
			t.Fatalf("dead letter %+v: want group 1 with reason %s", e, kvcore.ReasonTableGroupCount)
		}
	}
	recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicTransferResults)
	if err != nil {
		t.Fatal(err)
	}
	for _, rec := range recs {
		var r contract.TransferResult
		if json.Unmarshal(rec.Value, &r) != nil || r.TaskID != task.TaskID {
			continue
		}
		var g0, g1 contract.GroupOutcome
		for _, g := range r.Groups {
			switch g.Group {
			case 0:
				g0 = g
			case 1:
				g1 = g
			}
		}
		if g0.Stored+g0.Existing != 2 || g1.DeadLettered == 0 || r.Status != string(kvcore.SaveDeadLettered) {
			t.Fatalf("result of the malformed save: %+v", r)
		}
		return
	}
	t.Fatalf("no transfer result for %s", task.TaskID)
}

// checkGarbage: the garbage record is dead-lettered, with a reason, at its
// own partition and offset.
func checkGarbage(ctx context.Context, t *testing.T, s *stack) {
	t.Helper()
	recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicSaveTasks)
	if err != nil {
		t.Fatal(err)
	}
	var at *sim.Record
	for i := range recs {
		if recs[i].Key == garbageKey {
			at = &recs[i]
		}
	}
	if at == nil {
		t.Fatal("the garbage record is not on the topic")
	}
	eventually(t, "the garbage record in GET /v1/dlq", func() bool {
		for _, e := range dlq(t, s, url.Values{}) {
			if e.Topic == contract.TopicSaveTasks && e.Partition == at.Partition && e.Offset == at.Offset {
				if e.Reason == "" {
					t.Fatalf("dead letter of the garbage record has no reason: %+v", e)
				}
				return true
			}
		}
		return false
	})
}

// TestCorruptedValuesAreRecomputed fills the store with a first run, then
// overwrites every value with garbage (the keys stay, so lookups still find
// them) and plays the same prompts again on a fresh engine (an empty local
// prefix cache, the same salt), so every prefix is a store hit: the
// gpuworker reports those loads as load errors instead of putting wrong
// bytes in the pool, and the engine recomputes them, as vLLM does. No byte
// mismatches, no failed request. (Corrupting in the middle of one run
// depends on the local cache evicting a prefix first, which an idle machine
// may never do.)
func TestCorruptedValuesAreRecomputed(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := simConfig(t, s, false, smallWorkload(30, 8))
	first, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, first)
	err = testenv.EachKeyBatch(s.redisURL, s.prefix, func(ctx context.Context, c *redis.Client, keys []string) error {
		pairs := make([]any, 0, 2*len(keys))
		for _, k := range keys {
			pairs = append(pairs, k, "garbage")
		}
		return c.MSet(ctx, pairs...).Err()
	})
	if err != nil {
		t.Fatalf("corrupting the store: %v", err)
	}
	cfg.RunTag = sim.NewRunTag() // new request ids, the same salt: the same keys
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if rep.Verification.LoadErrorBlocks == 0 || rep.Tokens.Recomputed == 0 || rep.Ledger.LoadErrorBlocks == 0 {
		t.Fatalf("no load errors after corrupting the store: %+v, %d tokens recomputed", rep.Verification, rep.Tokens.Recomputed)
	}
}

// TestServiceKillsMidRun SIGKILLs every service of a 1P1D run in turn —
// sender, scheduler, lookup, the decode engine's gpuworker and the prefill
// engine's — and restarts each: the run completes with every request ok, no
// wrong byte loaded or stored, the ledger balanced and every tracker done.
// A killed gpuworker loses its pool: the blocks it held must come back as
// load errors (recomputed), block_not_held dead letters or, for a save whose
// puts found the worker down through every retry, put_failed keys the
// sender dead-lettered (sim.Config.WorkerRestarts) — never as success.
func TestServiceKillsMidRun(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := simConfig(t, s, true, smallWorkload(72, 2))
	cfg.WorkerRestarts = true
	progress, done := startRun(ctx, cfg)
	kills := []struct {
		name string
		at   int // requests done
	}{{"sender", 6}, {"scheduler", 16}, {"lookup", 26}, {"gpuworker-prefill", 36}, {"gpuworker", 46}}
	for _, step := range kills {
		waitProgress(t, progress, done, step.at)
		s.kill(step.name)
		t.Logf("killed %s", step.name)
		s.start(step.name)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	requireOK(t, r.rep)
	if r.rep.Verification.VerifiedBlocks == 0 || r.rep.Stored == nil {
		t.Fatalf("no load verified (%d blocks) or no stored-value check (%v)", r.rep.Verification.VerifiedBlocks, r.rep.Stored)
	}
	checkAllSaveTables(ctx, t, s, r.rep)
	for _, step := range kills {
		if err := s.alive(step.name); err != nil {
			t.Fatal(err)
		}
	}
}

// runResult is how a simulation played by startRun ended.
type runResult struct {
	rep *sim.Report
	err error
}

// startRun plays cfg in the background: progress holds the latest snapshot
// (every 50 ms; older ones are dropped), done receives the result.
func startRun(ctx context.Context, cfg sim.Config) (<-chan sim.Progress, <-chan runResult) {
	progress := make(chan sim.Progress, 1)
	cfg.Progress, cfg.ProgressEvery = func(p sim.Progress) {
		select {
		case <-progress:
		default:
		}
		progress <- p
	}, 50*time.Millisecond
	done := make(chan runResult, 1)
	go func() {
		rep, err := sim.Run(ctx, cfg)
		done <- runResult{rep, err}
	}()
	return progress, done
}

// waitProgress waits until at least n requests are done; it fails the test
// when the run ends first.
func waitProgress[T any](t *testing.T, progress <-chan sim.Progress, done <-chan T, n int) {
	t.Helper()
	for {
		select {
		case p := <-progress:
			if p.Done >= n {
				return
			}
		case <-done:
			t.Fatalf("the run ended before %d requests were done", n)
		}
	}
}
