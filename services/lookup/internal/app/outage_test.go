package app_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/logging"
)

// brokerEnv is an env with a broker of the test's own (which the test may
// stop) and the given Redis; these tests need no database.
func brokerEnv(t *testing.T, redisURL string) (*servicetest.Env, *devbroker.Broker) {
	t.Helper()
	b, err := devbroker.Start(context.Background(), devbroker.Config{Addr: "127.0.0.1:0", GroupMinSessionTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatalf("broker: %v", err)
	}
	t.Cleanup(b.Close)
	return &servicetest.Env{Brokers: b.Addrs(), RedisURL: redisURL}, b
}

// Series of the fail-open counter for the store child.
const (
	storeFailedUnavailable = `kvmesh_lookup_child_failures_total{child="store",reason="unavailable"}`
	storeFailedTimeout     = `kvmesh_lookup_child_failures_total{child="store",reason="timeout"}`
)

// storeFailures is how many store-child lookups failed open.
func (s *lookupService) storeFailures(t *testing.T) float64 {
	t.Helper()
	return s.metric(t, storeFailedUnavailable) + s.metric(t, storeFailedTimeout)
}

// readiness is a decoded GET /readyz answer (200 or 503).
type readiness struct {
	status   int
	Degraded []string                          `json:"degraded"`
	Failed   []string                          `json:"failed"`
	Checks   map[string]httpserver.CheckResult `json:"checks"`
}

func (s *lookupService) readyz(t *testing.T) readiness {
	t.Helper()
	resp, err := http.Get("http://" + s.addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	r := readiness{status: resp.StatusCode}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("decode /readyz %s: %v", b, err)
	}
	return r
}

// TestStoreOutageFailsOpen stops the store pool (a private redis-server)
// under a running store-only lookup: lookups answer 200 with 0 external
// tokens — the store child fails open, as vLLM's store child answers 0
// (MooncakeStoreWorker.lookup) — and publish that decision, with the store
// child marked failed; the failure counter rises, each failure is logged
// at WARN with its error and the request's trace, and /readyz stays 200
// while naming the store as degraded. When the store comes back (a
// restarted, empty redis-server on the same address) seeded keys hit
// again and /readyz is clean.
func TestStoreOutageFailsOpen(t *testing.T) {
	rs := testenv.StartRedis(t)
	env, _ := brokerEnv(t, rs.URL())
	logs := &testenv.SyncBuffer{}
	log, err := logging.New(logs, "info", "lookup")
	if err != nil {
		t.Fatal(err)
	}
	s := startLookupLog(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_TIMEOUT": "500ms"}, log)
	decisions := readDecisions(t, env.Brokers)
	seed := newSeeder(t, rs.URL())
	toks := tokens(48, 301)
	keys := groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)
	seed.put(t, keys...)
	if d := s.lookup(t, body("before", toks, 0)); d.ExternalTokens != 32 {
		t.Fatalf("before the outage: %d external tokens, want 32", d.ExternalTokens)
	}
	if r := s.readyz(t); r.status != http.StatusOK || len(r.Degraded) != 0 {
		t.Fatalf("before the outage: /readyz %+v, want 200 and nothing degraded", r)
	}
	if got := s.storeFailures(t); got != 0 {
		t.Fatalf("store failures before the outage: %v", got)
	}
	misses := s.metric(t, `kvmesh_lookup_requests_total{result="miss"}`)

	seed.forget()
	rs.Stop()
	const engineTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	for i := range 2 {
		res := s.post(t, body("during", toks, 0), map[string]string{"traceparent": "00-" + engineTrace + "-00f067aa0ba902b7-01"})
		d := decodeDecision(t, res)
		if d.ExternalTokens != 0 || d.Chosen != "" || d.Pending || len(d.Children) != 1 {
			t.Fatalf("lookup %d during the outage: %+v, want 0 external tokens from no child", i, d)
		}
		if c := d.Children[0]; c.Name != "store" || c.Tokens != 0 || c.Spec != nil ||
			(c.Failed != "unavailable" && c.Failed != "timeout") {
			t.Fatalf("lookup %d: store child %+v, want 0 tokens, failed unavailable or timeout", i, c)
		}
	}
	if got := s.storeFailures(t); got != 2 {
		t.Errorf("store child failures counted %v, want 2", got)
	}
	if got := s.metric(t, `kvmesh_lookup_requests_total{result="miss"}`) - misses; got != 2 {
		t.Errorf("miss lookups during the outage %v, want 2", got)
	}
	if got := s.metric(t, `kvmesh_store_failed_keys_total{op="lookup_exists",status="unavailable"}`) +
		s.metric(t, `kvmesh_store_failed_keys_total{op="lookup_exists",status="timeout"}`); got != 6 {
		t.Errorf("failed lookup_exists keys %v, want 6 (3 keys x 2 lookups)", got)
	}
	// The answered decision is the published one: the scheduler got it.
	if d, _ := decisions.await(t, "during"); d.ExternalTokens != 0 || len(d.Children) != 1 || d.Children[0].Failed == "" {
		t.Errorf("published decision %+v, want 0 tokens and the store child failed", d)
	}
	warned := 0
	for _, rec := range logs.Records(t) {
		if rec["level"] == "WARN" && rec["child"] == "store" {
			warned++
			if rec[logging.KeyTraceID] != engineTrace || !strings.Contains(rec["err"].(string), "store existence check failed") {
				t.Errorf("WARN record %v, want the engine's trace %s and the store error", rec, engineTrace)
			}
		}
	}
	if warned != 2 {
		t.Errorf("%d WARN records of a failed store child, want 2", warned)
	}
	r := s.readyz(t)
	if r.status != http.StatusOK || len(r.Degraded) != 1 || r.Degraded[0] != "store" ||
		r.Checks["store"].Status != httpserver.StatusFailed || r.Checks["store"].Error == "" || r.Checks["kafka"].Status != httpserver.StatusOK {
		t.Fatalf("/readyz during the outage %+v, want 200 with the store failed and degraded", r)
	}

	rs = testenv.RestartRedis(t, rs)
	seed = newSeeder(t, rs.URL())
	seed.put(t, keys...)
	eventually(t, "lookups hit again after the store came back", func() bool {
		return s.lookup(t, body("after", toks, 0)).ExternalTokens == 32
	})
	if r := s.readyz(t); r.status != http.StatusOK || len(r.Degraded) != 0 || r.Checks["store"].Status != httpserver.StatusOK {
		t.Fatalf("/readyz after the outage %+v, want 200 and nothing degraded", r)
	}
}

// TestStoreOutagePDHitWins: with the chain pd,store (make run's) and the
// store down, a request with kv_transfer_params is answered by the pd
// child (its hit wins, as in vLLM's MultiConnector, whose failed store
// child answered 0), while one without them is answered 0; both are 200.
func TestStoreOutagePDHitWins(t *testing.T) {
	rs := testenv.StartRedis(t)
	env, _ := brokerEnv(t, rs.URL())
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_TIMEOUT": "500ms", "KVMESH_LOOKUP_CONNECTORS": "pd,store"})
	toks := tokens(48, 311)
	src := &contract.PDSource{EngineID: "prefill-0", BlockTable: kvcore.BlockTable{{7, 8, 9}}, Tokens: 48}
	withPD := func(b map[string]any) map[string]any {
		b["kv_transfer_params"] = src
		return b
	}
	rs.Stop()

	d := s.lookup(t, withPD(body("pd-during", toks, 0)))
	if d.Chosen != "pd" || d.ExternalTokens != 32 || d.PD == nil || d.PD.EngineID != "prefill-0" {
		t.Fatalf("pd lookup during the outage: %+v, want pd chosen with 32 tokens", d)
	}
	if len(d.Children) != 2 || d.Children[0].Failed != "" || d.Children[1].Name != "store" || d.Children[1].Failed == "" || d.Children[1].Tokens != 0 {
		t.Fatalf("children %+v, want pd ok and the store failed with 0", d.Children)
	}
	if d := s.lookup(t, body("store-during", toks, 0)); d.Chosen != "" || d.ExternalTokens != 0 {
		t.Fatalf("lookup without pd params during the outage: %+v, want 0", d)
	}
	if got := s.storeFailures(t); got != 2 {
		t.Errorf("store child failures counted %v, want 2", got)
	}
	if got := s.metric(t, `kvmesh_lookup_requests_total{result="hit"}`); got != 1 {
		t.Errorf("hit lookups %v, want 1 (the pd hit)", got)
	}
}

// TestPublishFailureAnswers503 makes the broker refuse the decision's
// produce request under a running service (with an error kafka-go does not
// retry): the lookup answers 503 with Retry-After, so the engine never acts
// on a decision the scheduler did not get. Publishing is not a child of the
// chain and does not fail open: vLLM answers in-process and has no such
// step, and the mesh's scheduler only learns the engine's answer from the
// published record.
func TestPublishFailureAnswers503(t *testing.T) {
	env, broker := brokerEnv(t, testenv.RedisURL(t))
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_TIMEOUT": "2s"})
	if res := s.post(t, body("ok", tokens(48, 401), 0), nil); res.status != http.StatusOK {
		t.Fatalf("with the broker accepting: %d %s", res.status, res.body)
	}
	cluster := broker.Cluster()
	cluster.ControlKey(kmsg.Produce.Int16(), func(r kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		return refuseProduce(r.(*kmsg.ProduceRequest)), nil, true
	})
	res := s.post(t, body("lost", tokens(48, 402), 0), nil)
	p := res.problem(t, http.StatusServiceUnavailable)
	if ra := res.header.Get("Retry-After"); ra != "1" || p.Extras["result"] != "publish_failed" {
		t.Errorf("Retry-After %q, problem %+v; want 1 and result publish_failed", ra, p)
	}
	if got := s.metric(t, `kvmesh_lookup_requests_total{result="publish_failed"}`); got != 1 {
		t.Errorf("publish_failed lookups counted %v, want 1", got)
	}
}

// refuseProduce answers every partition of a produce request with
// TOPIC_AUTHORIZATION_FAILED.
func refuseProduce(req *kmsg.ProduceRequest) *kmsg.ProduceResponse {
	resp := req.ResponseKind().(*kmsg.ProduceResponse)
	for _, rt := range req.Topics {
		t := kmsg.NewProduceResponseTopic()
		t.Topic = rt.Topic
		for _, rp := range rt.Partitions {
			p := kmsg.NewProduceResponseTopicPartition()
			p.Partition = rp.Partition
			p.ErrorCode = 29 // TOPIC_AUTHORIZATION_FAILED: not retried
			t.Partitions = append(t.Partitions, p)
		}
		resp.Topics = append(resp.Topics, t)
	}
	return resp
}
