package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// events returns n request events of requests r0, r1, … (k events each).
func events(n, k int) []contract.RequestEvent {
	out := make([]contract.RequestEvent, n)
	for i := range out {
		out[i] = contract.RequestEvent{RequestID: fmt.Sprintf("r%d", i/k), Seq: int64(i%k + 1), Kind: contract.EventScheduled}
	}
	return out
}

// flatten concatenates the records' request events.
func flatten(recs []contract.EngineStep) []contract.RequestEvent {
	var out []contract.RequestEvent
	for _, r := range recs {
		out = append(out, r.Requests...)
	}
	return out
}

// TestStepRecordsSplit: a step's events go into one record up to
// MaxStepRequests events, and into several past it (or past the byte
// bound), each with its own step id, in order, none empty and none over the
// bounds; the events keep their order and every request its seqs.
func TestStepRecordsSplit(t *testing.T) {
	for _, tc := range []struct {
		name               string
		events, maxEvents  int
		maxBytes, wantRecs int
	}{
		{"one event", 1, contract.MaxStepRequests, maxStepBytes, 1},
		{"exactly the bound", contract.MaxStepRequests, contract.MaxStepRequests, 1 << 30, 1},
		{"one past the bound", contract.MaxStepRequests + 1, contract.MaxStepRequests, 1 << 30, 2},
		{"three records", 2*contract.MaxStepRequests + 7, contract.MaxStepRequests, 1 << 30, 3},
		{"small bound", 10, 3, 1 << 30, 4},
		{"byte bound", 10, contract.MaxStepRequests, 2 * (len(mustJSON(events(1, 3)[0])) + 1), 5}, // two events a record
		{"event over the byte bound", 3, contract.MaxStepRequests, 10, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			evs := events(tc.events, 3)
			recs := stepRecords("decode-0", "m", "sim-abc", 7, evs, tc.maxEvents, tc.maxBytes)
			if len(recs) != tc.wantRecs {
				t.Fatalf("%d records, want %d", len(recs), tc.wantRecs)
			}
			ids := map[string]bool{}
			for i, r := range recs {
				if r.Schema != contract.SchemaEngineStep || r.EngineID != "decode-0" || r.Model != "m" || r.Step != 7 {
					t.Fatalf("record %d: %+v", i, r)
				}
				want := "decode-0/sim-abc/7"
				if len(recs) > 1 {
					want = fmt.Sprintf("%s.%d", want, i+1)
				}
				if r.StepID != want || ids[r.StepID] {
					t.Fatalf("record %d: step id %q, want %q (unique)", i, r.StepID, want)
				}
				ids[r.StepID] = true
				if len(r.Requests) == 0 || len(r.Requests) > tc.maxEvents {
					t.Fatalf("record %d has %d events (bound %d)", i, len(r.Requests), tc.maxEvents)
				}
				// The bound counts each event's bytes and comma: the array's
				// bytes less one bracket.
				if size := len(mustJSON(r.Requests)) - 1; len(r.Requests) > 1 && size > tc.maxBytes {
					t.Fatalf("record %d: %d bytes of events over the bound %d", i, size, tc.maxBytes)
				}
			}
			if got := flatten(recs); !reflect.DeepEqual(got, evs) {
				t.Fatalf("the records' events differ from the step's")
			}
		})
	}
	if recs := stepRecords("e", "m", "t", 1, nil, contract.MaxStepRequests, maxStepBytes); len(recs) != 0 {
		t.Fatalf("no events: %d records", len(recs))
	}
}

// TestStepRecordsStable: building the same step again (a retried publish)
// gives the same records; another step or run gives other step ids.
func TestStepRecordsStable(t *testing.T) {
	evs := events(9, 3)
	a := stepRecords("e", "m", "run", 3, evs, 4, maxStepBytes)
	b := stepRecords("e", "m", "run", 3, evs, 4, maxStepBytes)
	if string(mustJSON(a)) != string(mustJSON(b)) {
		t.Fatal("the same step built twice differs")
	}
	seen := map[string]bool{}
	for _, recs := range [][]contract.EngineStep{a, stepRecords("e", "m", "run", 4, evs, 4, maxStepBytes), stepRecords("e", "m", "run2", 3, evs, 4, maxStepBytes)} {
		for _, r := range recs {
			if seen[r.StepID] {
				t.Fatalf("step id %q repeats across steps or runs", r.StepID)
			}
			seen[r.StepID] = true
		}
	}
}

// TestLongPromptStepIsSplitByBytes: a step that admits many 32K-token
// prompts (2048 block hashes each, twice: admitted and scheduled, and a
// 2048-block table per group) does not fit one record under the 1 MiB
// message limit; it is split, and every record stays under the limit.
func TestLongPromptStepIsSplitByBytes(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 8)
	out := newOutbox()
	for i := 0; len(mustJSON(out.events)) < 3<<20; i++ {
		r := testRequest(e, fmt.Sprintf("r%d", i), 32768, uint32(i)<<20)
		table := make(kvcore.BlockTable, 2)
		for g := range table {
			for b := range 2048 {
				table[g] = append(table[g], kvcore.BlockID(b))
			}
		}
		e.event(out, r, contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: len(r.prompt), BlockHashes: r.hexes})
		e.event(out, r, contract.RequestEvent{Kind: contract.EventAllocated, BlockTable: table})
		step := kvcore.Step{Kind: kvcore.StepNew, Tokens: 8192, Table: table, Hashes: r.hexes}
		e.event(out, r, contract.RequestEvent{Kind: contract.EventScheduled, Step: &step})
	}
	recs := stepRecords(e.id, e.model.Name, "run", 1, out.events, contract.MaxStepRequests, maxStepBytes)
	if len(recs) < 2 {
		t.Fatalf("%d record(s) for four 32K admissions, want a split", len(recs))
	}
	for _, r := range recs {
		if n := len(mustJSON(r)); n >= 1<<20 {
			t.Fatalf("record %s is %d bytes: over the 1 MiB message limit", r.StepID, n)
		}
	}
	if !slices.EqualFunc(flatten(recs), out.events, func(a, b contract.RequestEvent) bool { return a.RequestID == b.RequestID && a.Seq == b.Seq }) {
		t.Fatal("the split lost or reordered events")
	}
}

// TestPublishOneRecordPerStep publishes two steps of an engine through a
// broker: each is one record on the steps topic keyed by the engine id,
// holding the step's events in order, each with its request's traceparent
// (the request's span); the records themselves carry the trace context of
// the engine's step span.
func TestPublishOneRecordPerStep(t *testing.T) {
	testenv.RecordSpans(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2, Topics: []string{contract.TopicEngineSteps}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	pub, err := bus.NewProducer(b.Addrs())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	e, _ := testEngine(t, "hybrid-mla-linear", 8)
	e.pub, e.runTag = pub, "run"
	var engineSpan trace.Span
	_, engineSpan = otel.Tracer(tracerName).Start(ctx, "sim.engine")
	e.span = engineSpan
	defer engineSpan.End()
	var reqs []*request
	for i := range 3 {
		r := testRequest(e, fmt.Sprintf("run-%d", i), 40, uint32(i)*100)
		r.ctx, r.span = otel.Tracer(tracerName).Start(ctx, "sim.request")
		r.traceparent = traceparent(r.ctx)
		reqs = append(reqs, r)
	}
	first := newOutbox()
	for _, r := range reqs {
		e.event(first, r, contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 40, BlockHashes: r.hexes})
	}
	e.event(first, reqs[0], contract.RequestEvent{Kind: contract.EventAllocated})
	second := newOutbox()
	e.event(second, reqs[1], contract.RequestEvent{Kind: contract.EventFinished})
	for _, o := range []*outbox{first, second, newOutbox()} {
		if err := e.publish(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	recs, err := ReadAll(ctx, b.Addrs(), contract.TopicEngineSteps)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 2 {
		t.Fatalf("%d records for two steps (and an empty one), want 2", len(recs))
	}
	want := [][]string{{"run-0/1", "run-1/1", "run-2/1", "run-0/2"}, {"run-1/2"}}
	for i, rec := range recs {
		var s contract.EngineStep
		if err := json.Unmarshal(rec.Value, &s); err != nil {
			t.Fatal(err)
		}
		if rec.Key != e.id || s.EngineID != e.id || s.StepID != fmt.Sprintf("e/run/%d", i+1) || s.Step != int64(i+1) {
			t.Fatalf("record %d: key %q, step %+v", i, rec.Key, s)
		}
		var got []string
		for _, ev := range s.Requests {
			got = append(got, fmt.Sprintf("%s/%d", ev.RequestID, ev.Seq))
			r := reqs[ev.RequestID[len("run-")]-'0']
			if ev.Traceparent == "" || ev.Traceparent != traceparent(r.ctx) {
				t.Fatalf("event %s/%d: traceparent %q, want its request's %q", ev.RequestID, ev.Seq, ev.Traceparent, traceparent(r.ctx))
			}
		}
		if !slices.Equal(got, want[i]) {
			t.Fatalf("record %d: events %v, want %v", i, got, want[i])
		}
		tp := strings.Split(rec.Headers[contract.HeaderTraceparent], "-")
		if len(tp) != 4 || tp[1] != engineSpan.SpanContext().TraceID().String() {
			t.Fatalf("record %d: header traceparent %q, want the engine's trace %s", i, rec.Headers[contract.HeaderTraceparent], engineSpan.SpanContext().TraceID())
		}
	}
	var c EngineCounts
	e.stats.engine(e.id, func(ec *EngineCounts) { c = *ec })
	if c.Steps != 2 || c.StepRecords != 2 || c.Events != 5 {
		t.Fatalf("engine counts %+v, want 2 steps, 2 records, 5 events", c)
	}
}
