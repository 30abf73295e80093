package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// The mesh tests run the four services as processes (internal/testenv/
// meshtest) and play the simulator against them; without PostgreSQL and
// Redis they are skipped (failed with KVMESH_REQUIRE_SERVICES=1), and
// -short skips them.

// meshOptions shape one test's mesh.
type meshOptions struct {
	model      string
	connectors string   // the lookup's chain
	poolBlocks int      // every gpuworker's KVMESH_POOL_BLOCKS
	engines    int      // decode engines, each with its gpuworkers
	pd         bool     // a prefill engine (and gpuworkers) per decode engine
	tp         int      // the services' KVMESH_TP (0: the model's); every engine runs one gpuworker per rank
	env        []string // more settings of every service
}

// rankWorkerName is the process name of rank k's gpuworker of engine id.
func rankWorkerName(id string, k int) string {
	if k == 0 {
		return meshtest.GPUWorkerName(id)
	}
	return fmt.Sprintf("%s-rank%d", meshtest.GPUWorkerName(id), k)
}

// simMesh starts the services of a fleet and returns a config pointing the
// simulator at them (Fleet filled in, every check configured).
func simMesh(t *testing.T, o meshOptions, w Workload, e EngineConfig) Config {
	t.Helper()
	cfg, _ := simMeshOf(t, o, w, e)
	return cfg
}

// simMeshOf is simMesh that also returns the mesh, whose processes a test
// may kill.
func simMeshOf(t *testing.T, o meshOptions, w Workload, e EngineConfig) (Config, *meshtest.Mesh) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts the mesh's services; skipped with -short")
	}
	model, err := kvcore.Preset(o.model)
	if err != nil {
		t.Fatal(err)
	}
	env := append([]string{"KVMESH_MODEL=" + o.model, "KVMESH_LOG_LEVEL=info", "KVMESH_SHUTDOWN_TIMEOUT=3s",
		"KVMESH_KAFKA_SESSION_TIMEOUT=3s", "KVMESH_ADMIN_TOKEN=sim-test-token"}, o.env...)
	if o.tp > 0 {
		model.Parallel.TP = o.tp
		if err := model.Validate(); err != nil {
			t.Fatal(err)
		}
		env = append(env, fmt.Sprintf("KVMESH_TP=%d", o.tp))
	}
	m := meshtest.New(t, "sim", env...)
	if _, err := m.Start("scheduler", "scheduler", "KVMESH_MIGRATE=true"); err != nil {
		t.Fatal(err) // it migrates the database the others check
	}
	var ids []string
	for i := range o.engines {
		ids = append(ids, fmt.Sprintf("decode-%d", i))
		if o.pd {
			ids = append(ids, fmt.Sprintf("prefill-%d", i))
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, 3)
	wg.Go(func() { _, errs[0] = m.Start("lookup", "lookup", "KVMESH_LOOKUP_CONNECTORS="+o.connectors) })
	wg.Go(func() { _, errs[1] = m.Start("sender", "sender") })
	wg.Go(func() { errs[2] = startRankWorkers(m, model, ids, fmt.Sprintf("KVMESH_POOL_BLOCKS=%d", o.poolBlocks)) })
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	url := func(name string) string { return m.Procs.Process(name).URL() }
	endpoint := func(id string) Endpoint {
		ep := Endpoint{EngineID: id}
		for k := range model.WorldSize() {
			ep.WorkerURLs = append(ep.WorkerURLs, url(rankWorkerName(id, k)))
		}
		return ep
	}
	var fleet []Pair
	for i := range o.engines {
		p := Pair{Decode: endpoint(fmt.Sprintf("decode-%d", i))}
		if o.pd {
			p.Prefill = endpoint(fmt.Sprintf("prefill-%d", i))
		}
		fleet = append(fleet, p)
	}
	tag := NewRunTag()
	return Config{
		Model: model, Workload: w, Engine: e, PD: o.pd, Fleet: fleet,
		LookupURL: url("lookup"), SchedulerURL: url("scheduler"), SenderURL: url("sender"), RedisURL: m.RedisURL,
		Brokers: m.Brokers, RunTag: tag, Salt: tag, RequestTimeout: 45 * time.Second, SettleTimeout: 30 * time.Second,
		Credentials: &Credentials{Engine: MintEngineTokens(m.AuthKey), Operator: "sim-test-token"},
	}, m
}

// startRankWorkers starts one gpuworker per engine id and worker rank
// (rankWorkerName), concurrently, each with its engine id, rank and env,
// and waits until all are ready.
func startRankWorkers(m *meshtest.Mesh, model *kvcore.Model, ids []string, env ...string) error {
	var g errgroup.Group
	for _, id := range ids {
		for k, r := range model.WorkerRanks() {
			g.Go(func() error {
				_, err := m.Start(rankWorkerName(id, k), "gpuworker", append([]string{"KVMESH_ENGINE_ID=" + id,
					fmt.Sprintf("KVMESH_RANK_TP=%d", r.TP), fmt.Sprintf("KVMESH_RANK_PCP=%d", r.PCP),
					fmt.Sprintf("KVMESH_RANK_DCP=%d", r.DCP), fmt.Sprintf("KVMESH_RANK_PP=%d", r.PP)}, env...)...)
				if err != nil {
					return fmt.Errorf("gpuworker of engine %s rank %s: %w", id, r, err)
				}
				return nil
			})
		}
	}
	return g.Wait()
}

// requireClean fails the test unless the report is clean: every request
// ok, every loaded byte and stored value right, the ledger balanced in all
// and engine by engine, every tracker done.
func requireClean(t *testing.T, rep *Report) {
	t.Helper()
	logReport(t, rep)
	if !rep.OK || rep.Requests.Failed != 0 || rep.Requests.OK != rep.Requests.Total || rep.Verification.Mismatched != 0 ||
		!rep.Ledger.Balanced || rep.Trackers == nil || !rep.Trackers.OK || rep.Stored == nil || !rep.Stored.OK {
		js, _ := json.MarshalIndent(rep, "", "  ")
		t.Fatalf("simulation not clean:\n%s", js)
	}
	if rep.Ledger.Stored+rep.Ledger.Existing == 0 {
		t.Fatalf("the run saved nothing: %+v", rep.Ledger)
	}
	for _, l := range rep.Ledger.Engines {
		if !l.Balanced {
			t.Fatalf("engine %s's ledger does not balance: %+v", l.EngineID, l)
		}
	}
}

// logReport logs the report's text.
func logReport(t *testing.T, rep *Report) {
	t.Helper()
	var b strings.Builder
	_ = rep.WriteText(&b)
	t.Logf("report:\n%s", b.String())
}

// stepRecordsOf reads the run's engine step records and checks each is
// keyed by its engine, and that every run request's events, over all
// records in offset order, number 1, 2, 3, … with no gap. It returns the
// engines that published and every run request's scheduled steps.
func stepRecordsOf(ctx context.Context, t *testing.T, cfg Config) (engines map[string]int, scheduled map[string][]kvcore.Step) {
	t.Helper()
	recs, err := ReadAll(ctx, cfg.Brokers, contract.TopicEngineSteps)
	if err != nil {
		t.Fatal(err)
	}
	engines, scheduled = map[string]int{}, map[string][]kvcore.Step{}
	last := map[string]int64{}
	stepIDs := map[string]bool{}
	for _, rec := range recs {
		var s contract.EngineStep
		if err := json.Unmarshal(rec.Value, &s); err != nil {
			t.Fatalf("step record %d/%d: %v", rec.Partition, rec.Offset, err)
		}
		if s.Schema != contract.SchemaEngineStep || rec.Key != s.EngineID || len(s.Requests) == 0 || len(s.Requests) > contract.MaxStepRequests {
			t.Fatalf("step record %d/%d: key %q, %+v", rec.Partition, rec.Offset, rec.Key, s)
		}
		if stepIDs[s.StepID] {
			t.Fatalf("step id %s published twice", s.StepID)
		}
		stepIDs[s.StepID] = true
		for _, ev := range s.Requests {
			if !strings.HasPrefix(ev.RequestID, cfg.RunTag+"-") {
				continue
			}
			engines[s.EngineID]++
			k := s.EngineID + "/" + ev.RequestID
			if ev.Seq != last[k]+1 {
				t.Fatalf("request %s: seq %d after %d", k, ev.Seq, last[k])
			}
			last[k] = ev.Seq
			if ev.Kind == contract.EventScheduled && ev.Step != nil {
				scheduled[k] = append(scheduled[k], *ev.Step)
			}
		}
	}
	return engines, scheduled
}

// checkStepTraces: every step record carries the trace context of its
// engine's sim.engine span (one trace per engine), and every run request
// event carries the traceparent of its request's sim.request span on that
// engine.
func checkStepTraces(ctx context.Context, t *testing.T, cfg Config, spans *tracetest.SpanRecorder) {
	t.Helper()
	engineTrace, requestSpan := map[string]string{}, map[string]string{}
	for _, s := range spans.Ended() {
		attrs := map[attribute.Key]string{}
		for _, kv := range s.Attributes() {
			attrs[kv.Key] = kv.Value.Emit()
		}
		switch s.Name() {
		case "sim.engine":
			engineTrace[attrs["kvmesh.engine_id"]] = s.SpanContext().TraceID().String()
		case "sim.request":
			requestSpan[attrs["kvmesh.engine_id"]+"/"+attrs["kvmesh.request_id"]] = s.SpanContext().SpanID().String()
		}
	}
	recs, err := ReadAll(ctx, cfg.Brokers, contract.TopicEngineSteps)
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, rec := range recs {
		var s contract.EngineStep
		if err := json.Unmarshal(rec.Value, &s); err != nil {
			t.Fatal(err)
		}
		tp := strings.Split(rec.Headers[contract.HeaderTraceparent], "-")
		if len(tp) != 4 || engineTrace[s.EngineID] == "" || tp[1] != engineTrace[s.EngineID] {
			t.Fatalf("step %s: header traceparent %q, want one in engine %s's trace %q", s.StepID, rec.Headers[contract.HeaderTraceparent], s.EngineID, engineTrace[s.EngineID])
		}
		for _, ev := range s.Requests {
			parts := strings.Split(ev.Traceparent, "-")
			want := requestSpan[s.EngineID+"/"+ev.RequestID]
			if len(parts) != 4 || want == "" || parts[2] != want {
				t.Fatalf("step %s: event %s/%d has traceparent %q, want its sim.request span %q", s.StepID, ev.RequestID, ev.Seq, ev.Traceparent, want)
			}
			checked++
		}
	}
	if checked == 0 {
		t.Fatal("no request event to check")
	}
}

// TestFleetOfThreeEngines plays a workload over three engines, each with
// its own gpuworker, against one mesh: every engine completes requests,
// the ledger balances in all and on each engine (BlockStored events carry
// their blocks' prompt tokens, which the ledger checks), every request's events
// reach the scheduler as step records keyed by their engine with no seq
// gap, each in its request's trace, and the report's total sums the
// engines.
func TestFleetOfThreeEngines(t *testing.T) {
	spans := testenv.RecordSpans(t)
	w := Workload{
		Requests: 24, Turns: Range{Min: 2, Max: 3}, SystemPrompts: 2,
		SystemTokens: Range{Min: 64, Max: 192}, UserTokens: Range{Min: 16, Max: 64},
		OutputTokens: Range{Min: 4, Max: 20}, Rate: 8, ThinkTime: 20 * time.Millisecond, Seed: 54643, Vocab: 32000,
	}
	cfg := simMesh(t, meshOptions{model: "hybrid-mla-linear", connectors: "store", poolBlocks: 64, engines: 3}, w,
		EngineConfig{PoolBlocks: 48, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireClean(t, rep)
	if rep.Ledger.TokenEvents == 0 {
		t.Fatal("no BlockStored event carried token_ids: the admitted events' tokens did not reach the sender")
	}
	if len(rep.Engines) != 3 || len(rep.Ledger.Engines) != 3 {
		t.Fatalf("%d engines and %d engine ledgers in the report, want 3", len(rep.Engines), len(rep.Ledger.Engines))
	}
	var sum EngineCounts
	for _, e := range rep.Engines {
		if e.Role != RoleBoth || e.Requests-e.Failed == 0 || e.Steps == 0 || e.Ledger.SaveTasks == 0 {
			t.Fatalf("engine %s completed nothing: %+v", e.ID, e)
		}
		sum.add(e.EngineCounts)
	}
	if sum != rep.Total || rep.Total.Requests != rep.Requests.Total || rep.Trackers.Checked != rep.Requests.Total {
		t.Fatalf("total %+v, the engines sum to %+v; %d turns, %d trackers", rep.Total, sum, rep.Requests.Total, rep.Trackers.Checked)
	}
	engines, _ := stepRecordsOf(ctx, t, cfg)
	if len(engines) != 3 {
		t.Fatalf("step records of %d engines (%v), want 3", len(engines), engines)
	}
	for _, e := range rep.Engines {
		if engines[e.ID] != e.Events {
			t.Fatalf("engine %s: %d events on the topic, the report counts %d", e.ID, engines[e.ID], e.Events)
		}
	}
	checkStepTraces(ctx, t, cfg, spans)
}

// TestLongContextOnMesh plays the long-context preset at a few requests:
// every prompt is 8K-32K tokens, prefill is chunked over steps of at most
// the step budget, shared documents give prefix hits, and the run is clean
// with the ledger balanced.
func TestLongContextOnMesh(t *testing.T) {
	p, _ := LookupPreset("long-context")
	w := p.Workload
	w.Requests, w.SystemPrompts, w.Rate = 3, 1, 1 // one document: the later conversations share its prefix
	lengths, _, _ := longContextPrompts(t, w)
	cfg := simMesh(t, meshOptions{model: p.Model, connectors: "store", poolBlocks: p.WorkerPoolBlocks, engines: 1}, w, p.Engine)
	cfg.ReusePreempted = p.ReusePreempted
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireClean(t, rep)
	if rep.Requests.Total != len(lengths) || rep.Tokens.Prompt < len(lengths)*LongContextMinPrompt || rep.PrefixHitRate == 0 {
		t.Fatalf("%d requests, %d prompt tokens, hit rate %.2f: want %d long prompts with prefix hits", rep.Requests.Total, rep.Tokens.Prompt, rep.PrefixHitRate, len(lengths))
	}
	_, scheduled := stepRecordsOf(ctx, t, cfg)
	chunked := 0
	for k, steps := range scheduled {
		prefill := 0
		for i, s := range steps {
			if i > 0 && s.Kind != kvcore.StepNew && s.Kind != kvcore.StepResumed && s.Tokens-steps[i-1].Tokens > p.Engine.MaxBatchTokens {
				t.Fatalf("request %s: a step computed %d tokens, over the budget %d", k, s.Tokens-steps[i-1].Tokens, p.Engine.MaxBatchTokens)
			}
			if s.Kind == kvcore.StepNew || s.Kind == kvcore.StepRunning {
				prefill++
			}
		}
		if prefill > 1 {
			chunked++
		}
	}
	if chunked == 0 {
		t.Fatalf("no request's prefill took more than one step (%d requests scheduled)", len(scheduled))
	}
	if !slices.ContainsFunc(rep.Engines, func(e EngineSummary) bool { return e.StepRecords >= e.Steps && e.Steps > 0 }) {
		t.Fatalf("engines %+v published no steps", rep.Engines)
	}
}
