package e2e

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
)

// traceRunRequests is the size of TestRequestTraces's seed run (make
// traces plays 20).
const traceRunRequests = 24

// TestRequestTraces is make traces's check on every landing: the seed's
// stack (the MLA + linear-attention model at TP8, 1P1D over pd,store, 16
// gpuworkers), every service exporting OTLP to the in-process receiver,
// plays a short run of the seed preset, and its spans must keep the rule
// of checkRunTraces: each request one trace through all four services,
// no span of a request outside it, shared work linked, not adopted. The
// run must have applied records in batches (else the rule's hardest case
// went unchecked), and the check must catch an apply span of a batched
// event moved into another request's trace or under its batch's span.
func TestRequestTraces(t *testing.T) {
	rec := testenv.RecordSpans(t) // the simulator's own spans, in process
	recv := testenv.StartOTLPReceiver(t)
	s := newStack(t, stackOptions{model: tp8Model, connectors: "pd,store", poolBlocks: 192, env: []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.URL(), "OTEL_BSP_SCHEDULE_DELAY=100",
	}})
	cfg := seedConfig(t, s, traceRunRequests)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)

	// The services export in batches: poll until the traces are whole.
	var spans []testenv.ExportedSpan
	var got runTraces
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(30 * time.Second); ; {
		exported, errs := recv.Spans()
		if len(errs) > 0 {
			t.Fatalf("malformed OTLP exports: %v", errs)
		}
		spans = append(simSpans(rec), exported...)
		got = checkRunTraces(spans, cfg.RunTag, traceRunRequests)
		if len(got.problems) == 0 || time.Now().After(deadline) {
			break
		}
		<-tick.C
	}
	reportRunTraces(t, "the OTLP receiver", cfg.RunTag, traceRunRequests, got)
	if got.batches == 0 || got.batched == 0 {
		t.Fatalf("%d batch spans, %d request spans linked to one: the run applied no batch of records", got.batches, got.batched)
	}
	t.Run("the check catches a batched apply span in another request's trace", func(t *testing.T) {
		checkCatchesAdoption(t, spans, cfg.RunTag)
	})
	writePDTree(t, got)
}

// writePDTree logs the tree of a request that loaded its prompt from its
// prefill engine (a pd load), its repeated sibling subtrees — the eight
// ranks' loads, say — folded into one; with KVMESH_TRACE_TREE_OUT set, it
// is written there too (docs/observability.md shows it).
func writePDTree(t *testing.T, got runTraces) {
	t.Helper()
	for _, id := range slices.Sorted(maps.Keys(got.turns)) {
		tr := got.turns[id]
		if !slices.ContainsFunc(tr, func(s testenv.ExportedSpan) bool {
			return s.Name == "gpuworker.load" && s.Attrs["kvmesh.connector"] == "pd"
		}) {
			continue
		}
		out := fmt.Sprintf("## a request loaded from its prefill engine (%d spans, repeated siblings folded)\n%s", len(tr), foldedTree(tr))
		t.Logf("span tree:\n%s", out)
		if path := os.Getenv("KVMESH_TRACE_TREE_OUT"); path != "" {
			if err := os.WriteFile(path, []byte(out), 0o644); err != nil {
				t.Error(err)
			}
		}
		return
	}
	t.Error("no request of the run loaded from its prefill engine")
}

// foldedTree is tree with consecutive sibling subtrees of the same shape
// (services and names) shown once, at the first, their count appended (×n).
func foldedTree(spans []testenv.ExportedSpan) string { return renderTree(spans, true) }

// renderTree renders spans as an indented tree: service, name, and a few
// attributes, children in start order; with fold, sibling subtrees of
// the same shape are shown once, at the first, their count appended.
func renderTree(spans []testenv.ExportedSpan, fold bool) string {
	children := map[string][]testenv.ExportedSpan{}
	byID := map[string]bool{}
	for _, s := range spans {
		byID[s.SpanID] = true
	}
	for _, s := range spans {
		parent := s.ParentID
		if !byID[parent] {
			parent = ""
		}
		children[parent] = append(children[parent], s)
	}
	var shape func(s testenv.ExportedSpan) string // services and names, children sorted
	shape = func(s testenv.ExportedSpan) string {
		var kids []string
		for _, c := range children[s.SpanID] {
			kids = append(kids, shape(c))
		}
		slices.Sort(kids)
		return "(" + s.Service + " " + s.Name + strings.Join(kids, "") + ")"
	}
	key := func(s testenv.ExportedSpan) string {
		if fold {
			return shape(s)
		}
		return s.SpanID
	}
	var b strings.Builder
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		kids := children[parent]
		sort.SliceStable(kids, func(i, j int) bool { return kids[i].Start.Before(kids[j].Start) })
		groups := map[string]int{} // shape → times, with fold
		var order []testenv.ExportedSpan
		for _, k := range kids {
			if groups[key(k)]++; groups[key(k)] == 1 {
				order = append(order, k)
			}
		}
		for _, s := range order {
			times := ""
			if n := groups[key(s)]; n > 1 {
				times = fmt.Sprintf("  ×%d", n)
			}
			fmt.Fprintf(&b, "%s%-18s %s%s%s\n", strings.Repeat("  ", depth), s.Service, s.Name, treeAttrs(s), times)
			walk(s.SpanID, depth+1)
		}
	}
	walk("", 0)
	return b.String()
}

// checkCatchesAdoption breaks the propagation on purpose, on a copy of
// the run's spans: the apply span of a batched event is moved into another
// request's trace, under its root (what a scheduler parenting every change
// to the first record's context would do), then into its batch's trace,
// under the batch's span (what parenting it to the batch's context did).
// The check must report each, naming the span.
func checkCatchesAdoption(t *testing.T, spans []testenv.ExportedSpan, tag string) {
	base := checkRunTraces(spans, tag, traceRunRequests)
	shared := batchSpans(spans)
	victim, batch := -1, testenv.ExportedSpan{}
	for i, s := range spans {
		if s.Name != "scheduler.apply" {
			continue
		}
		for _, l := range s.Links {
			if shared[l] {
				victim = i
				batch = spanByID(spans, l)
			}
		}
	}
	if victim < 0 {
		t.Fatal("no apply span linked to a batch span")
	}
	rid := spans[victim].Attrs[attrRequestID]
	var other testenv.ExportedSpan // the root of another request's trace
	for id, tr := range base.turns {
		if id == spans[victim].TraceID {
			continue
		}
		for _, s := range tr {
			if s.ParentID == "" {
				other = s
			}
		}
	}
	cases := []struct {
		name   string
		parent testenv.ExportedSpan
	}{
		{"another request's trace", other},
		{"under its batch's span", batch},
	}
	for _, tc := range cases {
		broken := append([]testenv.ExportedSpan(nil), spans...)
		broken[victim].TraceID, broken[victim].ParentID = tc.parent.TraceID, tc.parent.SpanID
		got := checkRunTraces(broken, tag, traceRunRequests)
		found := false
		for _, p := range got.problems {
			found = found || strings.Contains(p, `"scheduler.apply" of `+rid+":")
		}
		if !found {
			t.Errorf("%s: the apply span of %s moved there (trace %s, parent %s %q): the check reports %q",
				tc.name, rid, tc.parent.TraceID, tc.parent.Service, tc.parent.Name, got.problems)
		}
	}
}

// spanByID is the span with id, or a zero span.
func spanByID(spans []testenv.ExportedSpan, id string) testenv.ExportedSpan {
	for _, s := range spans {
		if s.SpanID == id {
			return s
		}
	}
	return testenv.ExportedSpan{}
}
