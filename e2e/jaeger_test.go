package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
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
// The spans Jaeger returns must keep the rule of checkRunTraces, the
// check TestRequestTraces runs in make test on the OTLP receiver's spans:
// every request (a sim.turn of the run) one trace with one root, every
// parent present and spans of all four services; every span that names
// one of the run's requests in that request's trace, under no batch's
// span; no Kafka send a root of its own.
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
	var got runTraces
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for deadline := time.Now().Add(90 * time.Second); ; {
		spans, err := q.spans(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got = checkRunTraces(spans, tag, want)
		if len(got.problems) == 0 || time.Now().After(deadline) {
			break
		}
		<-tick.C
	}
	reportRunTraces(t, "Jaeger", tag, want, got)
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

// spans reads the traces holding a span of the simulator or of one of
// the four services, as exported spans: a span's parent is the reference
// Jaeger reads as its parent (jaegerParent), its other references are its
// links.
func (q jaegerQuery) spans(ctx context.Context) ([]testenv.ExportedSpan, error) {
	all := map[string]jaegerTrace{}
	for _, svc := range append([]string{svcSim}, meshServices...) {
		trs, err := q.traces(ctx, svc)
		if err != nil {
			return nil, err
		}
		for _, tr := range trs {
			all[tr.TraceID] = tr
		}
	}
	var out []testenv.ExportedSpan
	for id, tr := range all {
		for _, s := range tr.Spans {
			e := testenv.ExportedSpan{Service: tr.Processes[s.ProcessID].ServiceName, Name: s.OperationName,
				TraceID: id, SpanID: s.SpanID, ParentID: jaegerParent(id, s.References), Attrs: map[string]string{}}
			for _, r := range s.References {
				if r.SpanID != e.ParentID || r.TraceID != id {
					e.Links = append(e.Links, r.SpanID)
				}
			}
			for _, kv := range s.Tags {
				e.Attrs[kv.Key] = fmt.Sprint(kv.Value)
			}
			e.Kind = jaegerKinds[e.Attrs["span.kind"]]
			out = append(out, e)
		}
	}
	return out, nil
}

// jaegerKinds are the OTLP span kinds by Jaeger's span.kind tag.
var jaegerKinds = map[string]int{"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}

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
