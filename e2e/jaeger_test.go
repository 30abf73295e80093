package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The mesh's four services, as Jaeger names them (service.name).
var meshServices = []string{svcLookup, svcScheduler, svcSender, svcWorker}

// jaegerTag is a span attribute as Jaeger's query API returns it.
type jaegerTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

// jaegerReference is a span's parent (CHILD_OF) or link (FOLLOWS_FROM).
type jaegerReference struct {
	RefType string `json:"refType"`
	TraceID string `json:"traceID"`
	SpanID  string `json:"spanID"`
}

// jaegerTrace is a trace as Jaeger's query API (GET /api/traces) returns it.
type jaegerTrace struct {
	TraceID string `json:"traceID"`
	Spans   []struct {
		SpanID        string            `json:"spanID"`
		OperationName string            `json:"operationName"`
		ProcessID     string            `json:"processID"`
		References    []jaegerReference `json:"references"`
		Tags          []jaegerTag       `json:"tags"`
	} `json:"spans"`
	Processes map[string]struct {
		ServiceName string `json:"serviceName"`
	} `json:"processes"`
}

// TestJaegerTraces is `make traces`'s check (scripts/traces.sh), skipped
// unless KVMESH_JAEGER_URL names a Jaeger query API (e.g.
// http://127.0.0.1:16686) that a simulator run exported to, together with
// the services. KVMESH_JAEGER_RUN_TAG is the run's tag (kvmesh sim
// --run-tag), KVMESH_JAEGER_REQUESTS its request count, and
// KVMESH_JAEGER_SINCE the Unix time in microseconds before it started.
//
// Every request (a sim.turn of the run) must be one trace in Jaeger: one
// root, every parent present, spans of all four services, and every span
// that names one of the run's requests in that request's trace, so none
// of the run's spans (a Kafka send, say) sits in a trace of its own.
func TestJaegerTraces(t *testing.T) {
	base := os.Getenv("KVMESH_JAEGER_URL")
	if base == "" {
		t.Skip("KVMESH_JAEGER_URL not set (make traces sets it)")
	}
	tag := os.Getenv("KVMESH_JAEGER_RUN_TAG")
	want, err := strconv.Atoi(os.Getenv("KVMESH_JAEGER_REQUESTS"))
	if tag == "" || err != nil || want <= 0 {
		t.Fatalf("KVMESH_JAEGER_RUN_TAG (%q) and a positive KVMESH_JAEGER_REQUESTS (%v) are needed", tag, err)
	}
	since, err := strconv.ParseInt(os.Getenv("KVMESH_JAEGER_SINCE"), 10, 64)
	if err != nil {
		t.Fatalf("KVMESH_JAEGER_SINCE: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	q := jaegerQuery{base: strings.TrimSuffix(base, "/"), since: since}

	// Spans reach Jaeger in batches: poll until every request's trace is
	// whole, then report what is still wrong past the deadline.
	var problems []string
	var turns map[string]jaegerTrace
	var others map[string]int
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for deadline := time.Now().Add(90 * time.Second); ; {
		turns, others, problems, err = q.check(ctx, tag, want)
		if err != nil {
			t.Fatal(err)
		}
		if len(problems) == 0 || time.Now().After(deadline) {
			break
		}
		<-tick.C
	}
	if len(problems) > 0 {
		t.Fatalf("%d problem(s) with the run's traces in Jaeger:\n  %s", len(problems), strings.Join(problems, "\n  "))
	}
	spans, services := 0, map[string]bool{}
	for _, tr := range turns {
		spans += len(tr.Spans)
		for _, p := range tr.Processes {
			services[p.ServiceName] = true
		}
	}
	t.Logf("Jaeger holds %d traces for the %d requests of run %s, each one connected trace through %v (%d spans; services seen: %v)",
		len(turns), want, tag, meshServices, spans, slices.Sorted(maps.Keys(services)))
	for _, root := range slices.Sorted(maps.Keys(others)) {
		t.Logf("other traces (no request of the run in them), by root span: %s ×%d", root, others[root])
	}
}

// jaegerQuery reads traces from a Jaeger query API.
type jaegerQuery struct {
	base  string
	since int64 // Unix microseconds
}

// traces returns the traces holding a span of service since q.since.
func (q jaegerQuery) traces(ctx context.Context, service string) ([]jaegerTrace, error) {
	v := url.Values{"service": {service}, "start": {fmt.Sprint(q.since)}, "limit": {"10000"}}
	u := q.base + "/api/traces?" + v.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, fmt.Errorf("jaeger query: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("jaeger query %s: %w", u, err)
	}
	defer resp.Body.Close()
	var body struct {
		Data   []jaegerTrace `json:"data"`
		Errors []any         `json:"errors"`
	}
	if resp.StatusCode == http.StatusNotFound {
		return nil, nil // no span of service yet
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("jaeger query %s: status %s", u, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("jaeger query %s: decode: %w", u, err)
	}
	if len(body.Errors) > 0 {
		return nil, fmt.Errorf("jaeger query %s: %v", u, body.Errors)
	}
	return body.Data, nil
}

// check reads the traces of the simulator and the four services and
// returns the run's request traces (by trace id), the number of other
// traces by their root span ("service operation"), and what is wrong: a request count other than want, a trace that is not one connected
// tree through all four services, or a span of a run's request outside
// the traces of the run's requests.
func (q jaegerQuery) check(ctx context.Context, tag string, want int) (map[string]jaegerTrace, map[string]int, []string, error) {
	all := map[string]jaegerTrace{}
	for _, svc := range append([]string{svcSim}, meshServices...) {
		trs, err := q.traces(ctx, svc)
		if err != nil {
			return nil, nil, nil, err
		}
		for _, tr := range trs {
			all[tr.TraceID] = tr
		}
	}
	turns := map[string]jaegerTrace{}
	for id, tr := range all {
		for _, s := range tr.Spans {
			if s.OperationName == "sim.turn" && strings.HasPrefix(tagValue(s.Tags, "kvmesh.request_id"), tag) {
				turns[id] = tr
			}
		}
	}
	var problems []string
	if len(turns) != want {
		problems = append(problems, fmt.Sprintf("%d sim.turn traces of run %s, want %d", len(turns), tag, want))
	}
	for _, id := range slices.Sorted(maps.Keys(turns)) {
		problems = append(problems, jaegerTraceProblems(turns[id])...)
	}
	// Spans of the run's requests in traces of their own.
	strays, others := map[string]int{}, map[string]int{}
	for id, tr := range all {
		if _, ok := turns[id]; ok {
			continue
		}
		for _, s := range tr.Spans {
			if jaegerParent(id, s.References) == "" {
				others[tr.Processes[s.ProcessID].ServiceName+" "+s.OperationName]++
			}
			if rid := tagValue(s.Tags, "kvmesh.request_id"); strings.HasPrefix(rid, tag) {
				strays[fmt.Sprintf("trace %s (%d spans): %s %q of %s", id, len(tr.Spans),
					tr.Processes[s.ProcessID].ServiceName, s.OperationName, rid)]++
			}
		}
	}
	for _, s := range slices.Sorted(maps.Keys(strays)) {
		problems = append(problems, "outside the run's request traces: "+s)
	}
	// Kafka sends that left their messages' traces: a root producer span
	// with links (FOLLOWS_FROM references), a one-span trace in Jaeger.
	for id, tr := range all {
		for _, s := range tr.Spans {
			if !strings.HasPrefix(s.OperationName, "send") || len(s.References) == 0 {
				continue
			}
			if jaegerParent(id, s.References) == "" {
				problems = append(problems, fmt.Sprintf("trace %s: %s %q is a root with %d link(s)",
					id, tr.Processes[s.ProcessID].ServiceName, s.OperationName, len(s.References)))
			}
		}
	}
	return turns, others, problems, nil
}

// jaegerTraceProblems lists what keeps tr from being one connected trace
// with spans of all four services.
func jaegerTraceProblems(tr jaegerTrace) []string {
	ids := map[string]bool{}
	services := map[string]bool{}
	for _, s := range tr.Spans {
		ids[s.SpanID] = true
		services[tr.Processes[s.ProcessID].ServiceName] = true
	}
	var problems []string
	roots := 0
	for _, s := range tr.Spans {
		parent := jaegerParent(tr.TraceID, s.References)
		switch {
		case parent == "":
			roots++
		case !ids[parent]:
			problems = append(problems, fmt.Sprintf("trace %s: %s %q: parent %s not in the trace",
				tr.TraceID, tr.Processes[s.ProcessID].ServiceName, s.OperationName, parent))
		}
	}
	if roots != 1 {
		problems = append(problems, fmt.Sprintf("trace %s: %d root spans, want 1", tr.TraceID, roots))
	}
	for _, svc := range meshServices {
		if !services[svc] {
			problems = append(problems, fmt.Sprintf("trace %s (%d spans): no span of %s", tr.TraceID, len(tr.Spans), svc))
		}
	}
	return problems
}

// jaegerParent is the parent span id that refs give a span of trace id, as
// Jaeger reads them (model.Span.ParentSpanID): the first CHILD_OF reference
// into the trace, else the first FOLLOWS_FROM one. Jaeger keeps one
// reference per span it points to, so a consumer span that is a child of
// the producer span and links to it too keeps only the FOLLOWS_FROM.
// Empty for a root.
func jaegerParent(id string, refs []jaegerReference) string {
	for _, kind := range []string{"CHILD_OF", "FOLLOWS_FROM"} {
		for _, r := range refs {
			if r.RefType == kind && r.TraceID == id {
				return r.SpanID
			}
		}
	}
	return ""
}

// tagValue is the string form of tag key's value, or "" without one.
func tagValue(tags []jaegerTag, key string) string {
	for _, kv := range tags {
		if kv.Key == key {
			return fmt.Sprint(kv.Value)
		}
	}
	return ""
}
