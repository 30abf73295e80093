package e2e

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// The rule of kvmesh's traces (docs/observability.md, "One trace per
// request"), as runTraces checks it on the spans of a simulator run —
// exported to the in-process OTLP receiver (TestRequestTraces, in make
// test) or read back from Jaeger (TestJaegerTraces, make traces):
//
//   - every request of the run (a sim.turn span) is one trace: one root,
//     every parent in the trace, spans of all four services;
//   - every span that names one of the run's requests (kvmesh.request_id)
//     is in that request's trace, and no span of another request, nor a
//     span of work shared by many requests, is among its ancestors;
//   - work shared by many requests (a consumer span of a batch of records)
//     is the root of a trace of its own that no request's span is in, and
//     the requests' spans link to it;
//   - a Kafka send is never a root that only links to its messages' spans;
//   - no call into a service (a server span) starts a trace of its own.

// attrRequestID is the span attribute naming a request.
const attrRequestID = "kvmesh.request_id"

// runTraces is what a check found in the spans of one run.
type runTraces struct {
	// turns are the traces of the run's requests, by trace id.
	turns map[string][]testenv.ExportedSpan
	// others counts the other traces by their root ("service name").
	others map[string]int
	// batches counts the batch consumer spans (more than one record) and
	// batched is the number of request spans linked to one of them.
	batches, batched int
	// problems says what breaks the rule.
	problems []string
}

// checkRunTraces groups spans by trace and checks the run tagged tag, of
// want requests, against the rule above.
func checkRunTraces(spans []testenv.ExportedSpan, tag string, want int) runTraces {
	byTrace := map[string][]testenv.ExportedSpan{}
	for _, s := range spans {
		byTrace[s.TraceID] = append(byTrace[s.TraceID], s)
	}
	r := runTraces{turns: map[string][]testenv.ExportedSpan{}, others: map[string]int{}}
	owner := map[string]string{} // request id → its trace id
	for id, tr := range byTrace {
		for _, s := range tr {
			if rid := s.Attrs[attrRequestID]; s.Name == "sim.turn" && strings.HasPrefix(rid, tag) {
				r.turns[id], owner[rid] = tr, id
			}
		}
	}
	if len(r.turns) != want {
		r.problems = append(r.problems, fmt.Sprintf("%d sim.turn traces of run %s, want %d", len(r.turns), tag, want))
	}
	for _, id := range slices.Sorted(maps.Keys(r.turns)) {
		r.problems = append(r.problems, connectedProblems(id, r.turns[id])...)
	}
	shared := batchSpans(spans)
	r.batches = len(shared)
	for _, id := range slices.Sorted(maps.Keys(byTrace)) {
		r.checkTrace(id, byTrace[id], tag, owner, shared)
	}
	r.problems = append(r.problems, linkedRootSends(spans)...)
	for _, s := range spans {
		for _, l := range s.Links {
			if shared[l] && s.Attrs[attrRequestID] != "" {
				r.batched++
				break
			}
		}
	}
	return r
}

// checkTrace checks the spans of one trace that name a run's request: in
// their request's trace, under no other request's span and no shared
// span; and a trace that is no request's: counted by its root.
func (r *runTraces) checkTrace(id string, tr []testenv.ExportedSpan, tag string, owner map[string]string, shared map[string]bool) {
	byID := map[string]testenv.ExportedSpan{}
	for _, s := range tr {
		byID[s.SpanID] = s
	}
	_, isTurn := r.turns[id]
	for _, s := range tr {
		if !isTurn && s.ParentID == "" {
			r.others[s.Service+" "+s.Name]++
			if s.Kind == spanKindServer && slices.Contains(meshServices, s.Service) {
				// A call into a service (a data-plane put or read of a
				// request's blocks, say) that did not continue its caller's
				// trace: its spans name no request, so only their root shows it.
				r.problems = append(r.problems, fmt.Sprintf("trace %s (%d spans): %s %q, a server span, is the root of a trace of no request",
					id, len(tr), s.Service, s.Name))
			}
		}
		if shared[s.SpanID] && s.ParentID != "" {
			r.problems = append(r.problems, fmt.Sprintf("trace %s: the shared span %s %q has a parent, want the root of a trace of its own",
				id, s.Service, s.Name))
		}
		rid := s.Attrs[attrRequestID]
		if !strings.HasPrefix(rid, tag) {
			continue
		}
		want := requestTrace(rid, owner)
		switch {
		case want == "":
			r.problems = append(r.problems, fmt.Sprintf("%s %q of %s: no sim.turn of the run names the request", s.Service, s.Name, rid))
		case want != id && isTurn:
			r.problems = append(r.problems, fmt.Sprintf("%s %q of %s: in the trace of another request (%s), want %s",
				s.Service, s.Name, rid, id, want))
		case want != id:
			r.problems = append(r.problems, fmt.Sprintf("%s %q of %s: outside the run's request traces, in trace %s (%d spans), want %s",
				s.Service, s.Name, rid, id, len(tr), want))
		}
		for p, ok := byID[s.ParentID]; ok; p, ok = byID[p.ParentID] {
			if shared[p.SpanID] {
				r.problems = append(r.problems, fmt.Sprintf("%s %q of %s: adopted by the shared span %s %q (want a link)",
					s.Service, s.Name, rid, p.Service, p.Name))
				break
			}
			if prid := p.Attrs[attrRequestID]; prid != "" && requestTrace(prid, owner) != want {
				r.problems = append(r.problems, fmt.Sprintf("%s %q of %s: under %s %q of another request, %s",
					s.Service, s.Name, rid, p.Service, p.Name, prid))
				break
			}
		}
	}
}

// requestTrace is the trace of the request rid names: its own sim.turn's,
// else (a child request, such as the pd child on the prefill engine,
// named after its parent) the trace of the longest request id rid starts
// with. Empty when the run has no such request.
func requestTrace(rid string, owner map[string]string) string {
	if id, ok := owner[rid]; ok {
		return id
	}
	best, id := "", ""
	for r, t := range owner {
		if strings.HasPrefix(rid, r) && len(r) > len(best) {
			best, id = r, t
		}
	}
	return id
}

// connectedProblems lists what keeps the spans of trace id from being one
// connected trace with spans of all four services.
func connectedProblems(id string, tr []testenv.ExportedSpan) []string {
	ids := map[string]bool{}
	services := map[string]bool{}
	for _, s := range tr {
		ids[s.SpanID] = true
		services[s.Service] = true
	}
	var problems []string
	roots := 0
	for _, s := range tr {
		switch {
		case s.ParentID == "":
			roots++
		case !ids[s.ParentID]:
			problems = append(problems, fmt.Sprintf("trace %s: %s %q: parent %s not in the trace", id, s.Service, s.Name, s.ParentID))
		}
	}
	if roots != 1 {
		problems = append(problems, fmt.Sprintf("trace %s: %d root spans, want 1", id, roots))
	}
	for _, svc := range meshServices {
		if !services[svc] {
			problems = append(problems, fmt.Sprintf("trace %s (%d spans): no span of %s", id, len(tr), svc))
		}
	}
	return problems
}

// Span kinds, in OTLP numbering.
const (
	spanKindServer   = 2
	spanKindConsumer = 5
)

// batchSpans are the spans of work shared by many requests: the consumer
// spans of batches of more than one record (messaging.batch.message_count).
// (A producer's send of several messages is a leaf under its first
// message's span, linked to the others, and never a parent: the messages
// carry their own trace contexts.)
func batchSpans(spans []testenv.ExportedSpan) map[string]bool {
	out := map[string]bool{}
	for _, s := range spans {
		if n, err := strconv.Atoi(s.Attrs["messaging.batch.message_count"]); err == nil && n > 1 && s.Kind == spanKindConsumer {
			out[s.SpanID] = true
		}
	}
	return out
}

// linkedRootSends lists the Kafka sends that left their messages' traces:
// a root producer span with links, a one-span trace in a trace backend.
func linkedRootSends(spans []testenv.ExportedSpan) []string {
	var problems []string
	for _, s := range spans {
		if (s.Name == "send" || strings.HasPrefix(s.Name, "send ")) && s.ParentID == "" && len(s.Links) > 0 {
			problems = append(problems, fmt.Sprintf("trace %s: %s %q is a root with %d link(s), want a child of its first message's span",
				s.TraceID, s.Service, s.Name, len(s.Links)))
		}
	}
	return problems
}

// reportRunTraces fails t with every problem the check of a run's traces
// in backend found, else logs what the traces hold.
func reportRunTraces(t *testing.T, backend, tag string, want int, got runTraces) {
	t.Helper()
	if len(got.problems) > 0 {
		t.Fatalf("%d problem(s) with the run's traces in %s:\n  %s", len(got.problems), backend, strings.Join(got.problems, "\n  "))
	}
	spans, services := 0, map[string]bool{}
	for _, tr := range got.turns {
		spans += len(tr)
		for _, s := range tr {
			services[s.Service] = true
		}
	}
	t.Logf("%s holds %d traces for the %d requests of run %s, each one connected trace through %v (%d spans; services seen: %v); %d batch spans, linked from %d request spans",
		backend, len(got.turns), want, tag, meshServices, spans, slices.Sorted(maps.Keys(services)), got.batches, got.batched)
	for _, root := range slices.Sorted(maps.Keys(got.others)) {
		t.Logf("other traces (no request of the run in them), by root span: %s ×%d", root, got.others[root])
	}
}
