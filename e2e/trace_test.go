package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Service names of the processes, as their spans carry them.
const (
	svcSim       = "kvmesh-sim"
	svcLookup    = "kvmesh-lookup"
	svcScheduler = "kvmesh-scheduler"
	svcSender    = "kvmesh-sender"
	svcWorker    = "kvmesh-gpuworker"
)

// TestObservability runs the four services exporting OTLP to an in-test
// receiver, plays two single-request runs and a malformed save, then checks
// the traces (one per request, across every hop) and, after a run of two
// tenants over their quotas (playTenantQuotas), the metrics (every family a
// Grafana dashboard queries is served).
func TestObservability(t *testing.T) {
	rec := testenv.RecordSpans(t) // the simulator's own spans, in process
	recv := testenv.StartOTLPReceiver(t)
	// The dense model: a stored prefix is a hit at any block boundary (a
	// Mamba group would need its state at exactly the hit).
	s := newStack(t, stackOptions{model: "dense", connectors: "store", poolBlocks: 32, env: []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.URL(), "OTEL_BSP_SCHEDULE_DELAY=100",
	}})
	t.Run("one trace per request", func(t *testing.T) { checkOneTracePerRequest(t, s, rec, recv) })
	t.Run("every dashboard metric is served", func(t *testing.T) {
		playTenantQuotas(t, s) // the tenant quota families exist once quotas evict and skip
		checkDashboardMetrics(t, s)
	})
}

// checkOneTracePerRequest follows single requests through the services. A first run
// computes and saves a prompt; its request's trace must cover lookup →
// scheduler → sender → gpuworker → store. A second run of the same prompt
// (same salt, fresh engines) loads it from the store; its request's trace
// must cover lookup → scheduler → gpuworker load → store. Each trace must be
// connected (one root, every parent present), and a malformed save
// published inside a traced span must show the dead-lettered group's reason
// on a span of that trace.
//
// With KVMESH_TRACE_TREE_OUT set, the traces are also written there as
// indented span trees (docs/observability.md shows them).
func checkOneTracePerRequest(t *testing.T, s *stack, rec *tracetest.SpanRecorder, recv *testenv.OTLPReceiver) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := sim.Workload{
		Requests: 1, Turns: sim.Range{Min: 1, Max: 1}, SystemPrompts: 1,
		SystemTokens: sim.Range{Min: 160, Max: 160}, UserTokens: sim.Range{Min: 32, Max: 32},
		OutputTokens: sim.Range{Min: 4, Max: 4}, Rate: 10, Seed: 7, Vocab: 32000,
	}
	save := simConfig(t, s, false, w)
	repSave, err := sim.Run(ctx, save)
	if err != nil {
		t.Fatal(err)
	}
	if !repSave.OK || repSave.Ledger.Stored == 0 {
		b, _ := json.MarshalIndent(repSave, "", "  ")
		t.Fatalf("first run did not save its prompt cleanly:\n%s", b)
	}
	load := simConfig(t, s, false, w)
	load.Salt = save.Salt // the same prompt hashes to the keys the first run saved
	repLoad, err := sim.Run(ctx, load)
	if err != nil {
		t.Fatal(err)
	}
	if !repLoad.OK || repLoad.Tokens.Loaded["store"] == 0 || repLoad.Verification.Mismatched != 0 {
		b, _ := json.MarshalIndent(repLoad, "", "  ")
		t.Fatalf("second run did not load the saved prompt cleanly from the store:\n%s", b)
	}
	dlTrace, verdict := injectTracedMalformed(ctx, t, s)

	saveTrace := turnTrace(t, rec, save.RunTag)
	loadTrace := turnTrace(t, rec, load.RunTag)
	// Poll until every trace is complete; past the deadline the checks
	// below say what is missing.
	traces := map[string][]testenv.ExportedSpan{}
	collect := func() bool {
		exported, errs := recv.Spans()
		if len(errs) > 0 {
			t.Fatalf("malformed OTLP exports: %v", errs)
		}
		all := append(simSpans(rec), exported...)
		for _, id := range []string{saveTrace, loadTrace, dlTrace} {
			traces[id] = inTrace(all, id)
		}
		return complete(traces[saveTrace], savePath) && complete(traces[loadTrace], loadPath) &&
			complete(traces[dlTrace], deadLetterPath)
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(30 * time.Second); !collect() && time.Now().Before(deadline); {
		<-tick.C
	}

	checkTrace(t, "save", traces[saveTrace], savePath)
	checkTrace(t, "load", traces[loadTrace], loadPath)
	checkTrace(t, "dead letter", traces[dlTrace], deadLetterPath)
	checkDeadLetterSpan(t, traces[dlTrace], verdict)
	checkNoLinkedRootSends(t, recv)
	writeTrees(t, map[string][]testenv.ExportedSpan{
		"save (first run)": traces[saveTrace], "load (second run)": traces[loadTrace], "dead letter": traces[dlTrace],
	})
}

// hop is one span a trace must hold: its service (empty: any; an outbox
// row is published by whichever service's relay claims it first), its
// name (a trailing "*" matches any name with that prefix), the services its
// ancestors must pass through, nearest first, and, when set, the prefix of
// its parent's name.
type hop struct {
	service, name string
	via           []string
	under         string
}

// relaySend is the Kafka write of a relay batch: bus.Producer's send span,
// a child of the outbox publish span of the batch's first row (the relay
// publishes from a context without a span), not a trace of its own. In
// these runs, one request at a time on a database of the test's own, every
// trace with outbox rows holds at least one: each batch's first row is one
// of that request's.
var relaySend = hop{name: "send*", under: "outbox publish "}

// savePath is what the first run's request must show.
var savePath = []hop{
	{svcLookup, "lookup", []string{svcSim}, ""},
	{svcLookup, "store lookup_exists", []string{svcLookup, svcSim}, ""},
	{svcScheduler, "scheduler.apply", []string{svcScheduler, svcSim}, ""},
	{"", "outbox publish " + contract.TopicSaveTasks, []string{svcScheduler, svcSim}, ""},
	{svcSender, "sender.validate", []string{svcSender, svcScheduler, svcSim}, ""},
	{svcSender, "store save_exists", []string{svcSender, svcScheduler, svcSim}, ""},
	{svcWorker, "gpuworker.put", []string{svcWorker, svcSender, svcScheduler, svcSim}, ""},
	{svcWorker, "store save_put", []string{svcWorker, svcSender, svcScheduler, svcSim}, ""},
	relaySend,
}

// loadPath is what the second run's request must show.
var loadPath = []hop{
	{svcLookup, "store lookup_exists", []string{svcLookup, svcSim}, ""},
	{"", "outbox publish " + contract.TopicLoadTasks, []string{svcScheduler, svcSim}, ""},
	{svcWorker, "gpuworker.load", []string{svcWorker, svcScheduler, svcSim}, ""},
	{svcWorker, "store load_get", []string{svcWorker, svcScheduler, svcSim}, ""},
	{svcScheduler, "scheduler.apply", []string{svcScheduler, svcWorker, svcScheduler, svcSim}, ""},
	relaySend,
}

// deadLetterPath is what the traced malformed save must show.
var deadLetterPath = []hop{
	{svcSender, "sender.validate", []string{svcSender, "kvmesh-e2e-test"}, ""},
	{svcSender, "sender.dead_letter", []string{svcSender, "kvmesh-e2e-test"}, ""},
	{"", "outbox publish " + contract.TopicSaveDLQ, []string{svcSender, "kvmesh-e2e-test"}, ""},
	relaySend,
}

// turnTrace is the trace id of the (only) turn of run tag.
func turnTrace(t *testing.T, rec *tracetest.SpanRecorder, tag string) string {
	t.Helper()
	for _, s := range rec.Ended() {
		if s.Name() != "sim.turn" {
			continue
		}
		for _, kv := range s.Attributes() {
			if kv.Key == "kvmesh.request_id" && strings.HasPrefix(kv.Value.AsString(), tag) {
				return s.SpanContext().TraceID().String()
			}
		}
	}
	t.Fatalf("no sim.turn span of run %s", tag)
	return ""
}

// injectTracedMalformed publishes a save whose chunk lists no hashes for
// its blocks inside a span of the test, and returns its trace id and the
// verdict the sender must dead-letter it with.
func injectTracedMalformed(ctx context.Context, t *testing.T, s *stack) (string, kvcore.GroupVerdict) {
	t.Helper()
	m, _ := kvcore.Preset(s.model)
	hashes := kvcore.HashChain(make([]uint32, 32), m.HashBlockSize, []byte(sim.NewRunTag()))
	task := kvcore.SaveTask{
		Schema: kvcore.SchemaSaveTask, TaskID: decodeEngine + "/traced-malformed/save/1", EngineID: decodeEngine,
		RequestID: "traced-malformed", Model: m.Name, Start: 0, End: 32,
		BlockTable: kvcore.BlockTable{{0, 1}}, BlockHashes: []string{hashes[0].Hex()}, // two blocks, one hash
		Groups: m.SaveGroups(0, 32),
	}
	var verdict kvcore.GroupVerdict
	for _, v := range kvcore.ValidateSave(m, nil, &task) {
		if !v.OK() {
			verdict = v
			break
		}
	}
	if verdict.OK() {
		t.Fatal("the injected save is valid; the test needs a malformed one")
	}
	value, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	ctx, span := otel.Tracer("kvmesh-e2e-test").Start(ctx, "engine.save")
	defer span.End()
	publishSaveTasks(ctx, t, s, bus.Message{Key: task.RequestID, Value: value})
	return span.SpanContext().TraceID().String(), verdict
}

// simSpans converts the in-process spans: the simulator's (service
// kvmesh-sim) and the test's own (its instrumentation scope name).
func simSpans(rec *tracetest.SpanRecorder) []testenv.ExportedSpan {
	var out []testenv.ExportedSpan
	for _, s := range rec.Ended() {
		out = append(out, exported(s))
	}
	return out
}

func exported(s sdktrace.ReadOnlySpan) testenv.ExportedSpan {
	service := svcSim
	if scope := s.InstrumentationScope().Name; scope == "kvmesh-e2e-test" {
		service = scope
	}
	e := testenv.ExportedSpan{
		Service: service, Name: s.Name(), TraceID: s.SpanContext().TraceID().String(),
		SpanID: s.SpanContext().SpanID().String(), Kind: int(s.SpanKind()), Attrs: map[string]string{},
		Start: s.StartTime(),
	}
	if s.Parent().IsValid() {
		e.ParentID = s.Parent().SpanID().String()
	}
	for _, kv := range s.Attributes() {
		e.Attrs[string(kv.Key)] = kv.Value.Emit()
	}
	return e
}

// inTrace returns the spans of trace id.
func inTrace(spans []testenv.ExportedSpan, id string) []testenv.ExportedSpan {
	var out []testenv.ExportedSpan
	for _, s := range spans {
		if s.TraceID == id {
			out = append(out, s)
		}
	}
	return out
}

// complete reports whether spans form one connected tree holding every hop.
func complete(spans []testenv.ExportedSpan, path []hop) bool {
	return len(traceProblems(spans, path)) == 0
}

// checkTrace fails the test with every problem of the trace.
func checkTrace(t *testing.T, what string, spans []testenv.ExportedSpan, path []hop) {
	t.Helper()
	if problems := traceProblems(spans, path); len(problems) > 0 {
		t.Errorf("%s trace (%d spans):\n  %s\n%s", what, len(spans), strings.Join(problems, "\n  "), tree(spans))
	}
}

// traceProblems lists what keeps spans from being one connected trace
// holding every hop of path.
func traceProblems(spans []testenv.ExportedSpan, path []hop) []string {
	byID := map[string]testenv.ExportedSpan{}
	for _, s := range spans {
		byID[s.SpanID] = s
	}
	var problems []string
	roots := 0
	for _, s := range spans {
		if s.ParentID == "" {
			roots++
		} else if _, ok := byID[s.ParentID]; !ok {
			problems = append(problems, fmt.Sprintf("%s %q: parent %s not in the trace", s.Service, s.Name, s.ParentID))
		}
	}
	if roots != 1 {
		problems = append(problems, fmt.Sprintf("%d root spans, want 1", roots))
	}
	for _, h := range path {
		if !slices.ContainsFunc(spans, func(s testenv.ExportedSpan) bool { return h.matches(s, byID) }) {
			problems = append(problems, fmt.Sprintf("no %s %q under %v", h.service, h.name, h.via))
		}
	}
	return problems
}

// matches reports whether s is the hop, reached through its services.
func (h hop) matches(s testenv.ExportedSpan, byID map[string]testenv.ExportedSpan) bool {
	name, ok := strings.CutSuffix(h.name, "*")
	if (h.service != "" && s.Service != h.service) || (ok && !strings.HasPrefix(s.Name, name)) || (!ok && s.Name != name) {
		return false
	}
	if h.under != "" && !strings.HasPrefix(byID[s.ParentID].Name, h.under) {
		return false
	}
	var services []string // the services of s's ancestors, nearest first, runs collapsed
	for p, ok := byID[s.ParentID]; ok; p, ok = byID[p.ParentID] {
		if len(services) == 0 || services[len(services)-1] != p.Service {
			services = append(services, p.Service)
		}
	}
	return isSubsequence(h.via, services)
}

// isSubsequence reports whether want appears in got in order.
func isSubsequence(want, got []string) bool {
	i := 0
	for _, g := range got {
		if i < len(want) && g == want[i] {
			i++
		}
	}
	return i == len(want)
}

// checkNoLinkedRootSends fails the test for every exported producer send
// span that is a root with links: a batch's Kafka write that left the
// traces of its messages and would show in a trace backend as a one-span
// trace of its own.
func checkNoLinkedRootSends(t *testing.T, recv *testenv.OTLPReceiver) {
	t.Helper()
	exported, _ := recv.Spans()
	sends := 0
	for _, s := range exported {
		if s.Kind != 4 || (s.Name != "send" && !strings.HasPrefix(s.Name, "send ")) {
			continue
		}
		sends++
		if s.ParentID == "" && len(s.Links) > 0 {
			t.Errorf("%s %q in trace %s is a root span with %d link(s), want a child of its first message's span",
				s.Service, s.Name, s.TraceID, len(s.Links))
		}
	}
	if sends == 0 {
		t.Error("no producer send span exported")
	}
}

// checkDeadLetterSpan checks that the dead-lettered group's span carries
// the verdict's reason and group, an id and the error status.
func checkDeadLetterSpan(t *testing.T, spans []testenv.ExportedSpan, v kvcore.GroupVerdict) {
	t.Helper()
	for _, s := range spans {
		if s.Name != "sender.dead_letter" {
			continue
		}
		if s.Attrs["kvmesh.reason"] != string(v.Reason) || s.Attrs["kvmesh.group"] != fmt.Sprint(v.Group) ||
			!s.Error || s.Status != string(v.Reason) || s.Attrs["kvmesh.dead_letter_id"] == "" {
			t.Errorf("dead-letter span %+v: want reason %s on group %d, an id and error status", s, v.Reason, v.Group)
		}
		return
	}
	t.Error("no sender.dead_letter span in the malformed save's trace")
}

// tree renders spans as an indented tree: service, name, and a few
// attributes, children in start order.
func tree(spans []testenv.ExportedSpan) string { return renderTree(spans, false) }

// treeAttrs picks the attributes worth showing in a tree.
func treeAttrs(s testenv.ExportedSpan) string {
	var parts []string
	for _, k := range []string{"kvmesh.record", "kvmesh.change", "kvmesh.connector", "kvmesh.reason", "kvmesh.group", "kvmesh.groups", "kvmesh.store.keys",
		"kvmesh.bytes", "kvmesh.result", "db.operation.batch.size"} {
		if v, ok := s.Attrs[k]; ok {
			parts = append(parts, strings.TrimPrefix(k, "kvmesh.")+"="+v)
		}
	}
	if s.Error {
		parts = append(parts, "ERROR")
	}
	if len(parts) == 0 {
		return ""
	}
	return "  [" + strings.Join(parts, " ") + "]"
}

// writeTrees logs the trees and, with KVMESH_TRACE_TREE_OUT set, writes them
// to that file.
func writeTrees(t *testing.T, traces map[string][]testenv.ExportedSpan) {
	t.Helper()
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(traces)) {
		fmt.Fprintf(&b, "## %s (%d spans)\n%s\n", name, len(traces[name]), tree(traces[name]))
	}
	t.Logf("span trees:\n%s", b.String())
	if out := os.Getenv("KVMESH_TRACE_TREE_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Errorf("write %s: %v", out, err)
		}
	}
}
