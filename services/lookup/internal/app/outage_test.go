package app_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
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

// TestStoreOutageAnswers503 stops the store pool under a running service:
// lookups that need it answer 503 with Retry-After and never a count, and
// publish no decision.
func TestStoreOutageAnswers503(t *testing.T) {
	rs := testenv.StartRedis(t)
	env, _ := brokerEnv(t, rs.URL())
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_TIMEOUT": "500ms"})
	decisions := readDecisions(t, env.Brokers)
	seed := newSeeder(t, rs.URL())
	toks := tokens(48, 301)
	seed.put(t, groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)...)
	if d := s.lookup(t, body("before", toks, 0)); d.ExternalTokens != 32 {
		t.Fatalf("before the outage: %d external tokens, want 32", d.ExternalTokens)
	}

	seed.forget()
	rs.Stop()
	for i := range 2 {
		res := s.post(t, body("during", toks, 0), nil)
		p := res.problem(t, http.StatusServiceUnavailable)
		if ra := res.header.Get("Retry-After"); ra != "1" {
			t.Errorf("lookup %d: Retry-After %q, want 1", i, ra)
		}
		if p.Extras["result"] != "store_unavailable" {
			t.Errorf("lookup %d: problem %+v, want result store_unavailable", i, p)
		}
	}
	if got := s.metric(t, `kvmesh_lookup_requests_total{result="store_unavailable"}`); got != 2 {
		t.Errorf("store_unavailable lookups counted %v, want 2", got)
	}
	if got := s.metric(t, `kvmesh_store_failed_keys_total{op="lookup_exists",status="unavailable"}`) +
		s.metric(t, `kvmesh_store_failed_keys_total{op="lookup_exists",status="timeout"}`); got != 6 {
		t.Errorf("failed lookup_exists keys %v, want 6 (3 keys x 2 lookups)", got)
	}
	// A short prompt needs no store: it is answered and published with the
	// same key, after anything the failed lookups could have published.
	if d := s.lookup(t, body("during", toks[:12], 0)); d.ExternalTokens != 0 {
		t.Fatalf("short prompt during the outage: %d tokens, want 0", d.ExternalTokens)
	}
	d, _ := decisions.await(t, "during")
	if d.NumTokens != 12 {
		t.Fatalf("first decision keyed %q has %d tokens: a failed lookup published a decision", "during", d.NumTokens)
	}
}

// TestPublishFailureAnswers503 makes the broker refuse the decision's
// produce request under a running service (with an error kafka-go does not
// retry): the lookup answers 503 with Retry-After, so the engine never acts
// on a decision the scheduler did not get.
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
