package app_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// vllmSeries is the exposition line name of one series of a vLLM store
// family of the lookup's existence checks, as /metrics writes it (labels
// sorted).
func (s *lookupService) vllmSeries(family, engine, status string) string {
	return fmt.Sprintf(`%s{engine=%q,model_name=%q,operation="lookup_exists",status=%q}`, family, engine, s.model.Name, status)
}

// TestVLLMStoreFamiliesOfLookups checks vLLM's store families of the
// lookup's existence checks against a private redis-server: two lookups of
// one engine and one of another while it answers (ok, labelled with each
// request's engine), then one after it stopped (error, every key failed).
func TestVLLMStoreFamiliesOfLookups(t *testing.T) {
	rs := testenv.StartRedis(t)
	env, _ := brokerEnv(t, rs.URL())
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_TIMEOUT": "500ms"})
	seed := newSeeder(t, rs.URL())
	toks := tokens(48, 501)
	seed.put(t, groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)...)
	other := body("other-engine", toks, 0)
	other["engine_id"] = "engine-1"
	for _, b := range []map[string]any{body("a", toks, 0), body("b", toks, 0), other} {
		if d := s.lookup(t, b); d.ExternalTokens != 32 {
			t.Fatalf("lookup %v: %d external tokens, want 32", b["request_id"], d.ExternalTokens)
		}
	}
	seed.forget()
	rs.Stop()
	if d := s.lookup(t, body("during", toks, 0)); d.ExternalTokens != 0 {
		t.Fatalf("lookup during the outage: %d external tokens, want 0", d.ExternalTokens)
	}

	const (
		calls  = "vllm:mooncake_store_operation_total"
		keys   = "vllm:mooncake_store_operation_keys_total"
		bytes  = "vllm:mooncake_store_operation_bytes_total"
		failed = "vllm:mooncake_store_operation_failed_keys_total"
	)
	cases := []struct {
		family, engine, status string
		want                   float64
	}{
		{calls, "engine-0", "ok", 2},
		{keys, "engine-0", "ok", 6}, // 3 keys a lookup of 48 tokens
		{failed, "engine-0", "ok", 0},
		{bytes, "engine-0", "ok", 0}, // an existence check moves no value
		{calls, "engine-1", "ok", 1},
		{keys, "engine-1", "ok", 3},
		{calls, "engine-0", "error", 1},
		{keys, "engine-0", "error", 3},
		{failed, "engine-0", "error", 3},
		{calls, "engine-1", "error", 0}, // created at 0 by engine-1's first lookup
	}
	for _, tc := range cases {
		series := s.vllmSeries(tc.family, tc.engine, tc.status)
		if got := s.metric(t, series); got != tc.want {
			t.Errorf("%s = %v, want %v", series, got, tc.want)
		}
	}
	resp, err := http.Get("http://" + s.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	page, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if line := s.vllmSeries(calls, "engine-1", "error") + " 0\n"; !strings.Contains(string(page), line) {
		t.Errorf("/metrics does not serve %q", line)
	}
}
