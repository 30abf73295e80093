package app_test

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/api"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

// specFullSWA32 is a hybrid of full attention and a sliding window of two
// blocks (window 32 at block size 16: ceil(31/16) = 2 blocks before a hit).
const specFullSWA32 = `name: test-model
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 1024}
  - {kind: sliding_window, block_size: 16, window: 32, bytes_per_block: 256}
`

// scoreRoute is POST /v1/score as the OpenAPI document names it.
var scoreRoute = httpserver.Route{Method: http.MethodPost, Pattern: "/v1/score"}

// score posts body to /v1/score and decodes a 200 answer strictly,
// checking it against the OpenAPI document.
func (s *lookupService) score(t *testing.T, body any, headers map[string]string) adminapi.ScoreResponse {
	t.Helper()
	res := s.postTo(t, "/v1/score", body, headers)
	if res.status != http.StatusOK {
		t.Fatalf("score: status %d: %s", res.status, res.body)
	}
	checkScoreResponse(t, res)
	var out adminapi.ScoreResponse
	dec := json.NewDecoder(bytes.NewReader(res.body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&out); err != nil {
		t.Fatalf("decode score %s: %v", res.body, err)
	}
	return out
}

// checkScoreResponse fails unless res is an answer the OpenAPI document
// declares for POST /v1/score.
func checkScoreResponse(t *testing.T, res response) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, "http://lookup/v1/score", nil)
	if err != nil {
		t.Fatal(err)
	}
	servicetest.ParseOpenAPI(t, app.OpenAPI).CheckResponse(t, scoreRoute, req, res.status, res.header, res.body)
}

// scoreBody is a score request by token ids.
func scoreBody(toks []uint32, tenant string) map[string]any {
	b := map[string]any{"model": "test-model", "token_ids": toks}
	if tenant != "" {
		b["tenant"] = tenant
	}
	return b
}

// TestScoreHybridOverCount: the store holds every full-attention block of
// a 64-token prompt but, of the sliding-window group, only its first block
// (not the window before any longer hit). A group-folding router counts 64
// tokens; the hybrid hit, the lookup's own, is 16. The score says both,
// with each group's counts, in every prompt form (the binary body too),
// for the tenant's keys.
func TestScoreHybridOverCount(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specFullSWA32)})
	toks := tokens(64, 2701)
	hashes := kvcore.HashChain(toks, 16, nil)
	kb := s.keys().ForTenant("acme")
	seed.put(t, groupKeys(kb, 0, hashes, 0, 1, 2, 3)...)
	seed.put(t, groupKeys(kb, 1, hashes, 0)...)
	hits := s.metric(t, `kvmesh_lookup_scores_total{outcome="hit"}`)

	want := adminapi.TierScore{HitTokens: 16, AnyGroupPrefixTokens: 64, Groups: []adminapi.GroupScore{
		{Group: 0, Kind: "full_attention", BlockSize: 16, PrefixTokens: 64, UsableTokens: 64},
		{Group: 1, Kind: "sliding_window", BlockSize: 16, PrefixTokens: 16, UsableTokens: 16},
	}}
	raw := make([]byte, 0, 4*len(hashes[0]))
	for _, h := range hashes {
		raw = append(raw, h...)
	}
	forms := map[string]map[string]any{
		"token_ids":    scoreBody(toks, "acme"),
		"block_hashes": {"model": "test-model", "tenant": "acme", "block_hashes": hexes(hashes), "num_tokens": 64},
		"block_hashes_b64": {"model": "test-model", "tenant": "acme", "num_tokens": 64,
			"block_hashes_b64": base64.StdEncoding.EncodeToString(raw), "block_hash_bytes": len(hashes[0])},
	}
	for name, b := range forms {
		t.Run(name, func(t *testing.T) {
			got := s.score(t, b, nil)
			if !reflect.DeepEqual(got.Store, want) || got.Tenant != "acme" || got.NumTokens != 64 || got.Model != "test-model" {
				t.Fatalf("score %s, want store %s for tenant acme, 64 tokens", asJSON(got), asJSON(want))
			}
		})
	}
	t.Run("binary", func(t *testing.T) {
		head := map[string]any{"model": "test-model", "tenant": "acme", "num_tokens": 64, "block_hash_bytes": len(hashes[0])}
		if got := s.score(t, binaryBody(t, head, hashes), binaryType); !reflect.DeepEqual(got.Store, want) {
			t.Fatalf("binary score %s, want store %s", asJSON(got), asJSON(want))
		}
	})
	if d := s.lookup(t, withTenant(body("score-agrees", toks, 0), "acme")); d.ExternalTokens != want.HitTokens {
		t.Errorf("the lookup of the same prompt answered %d external tokens, the score's hit_tokens is %d", d.ExternalTokens, want.HitTokens)
	}
	if got := s.metric(t, `kvmesh_lookup_scores_total{outcome="hit"}`) - hits; got != float64(len(forms)+1) {
		t.Errorf("scores counted as hits %v, want %d", got, len(forms)+1)
	}
	// Another tenant's score sees none of acme's blocks.
	if got := s.score(t, scoreBody(toks, "globex"), nil).Store; got.HitTokens != 0 || got.AnyGroupPrefixTokens != 0 {
		t.Errorf("tenant globex's score %s, want nothing held", asJSON(got))
	}
}

func withTenant(b map[string]any, tenant string) map[string]any {
	b["tenant"] = tenant
	return b
}

// TestScoreCredentials: with authentication required, POST /v1/score
// takes an engine or the operator credential: none is 401, a service
// token 403, an engine token scores only the tenants it serves (another
// is 403), the operator token every tenant.
func TestScoreCredentials(t *testing.T) {
	env := servicetest.NewEnv(t)
	s := startLookup(t, env, map[string]string{
		"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_AUTH": auth.ModeRequired,
		"KVMESH_AUTH_KEY": servicetest.AuthKey, "KVMESH_ADMIN_TOKEN": "test-token",
	})
	key, err := auth.NewKey(servicetest.AuthKey)
	if err != nil {
		t.Fatal(err)
	}
	mint := func(kind auth.Kind, subject string, tenants ...string) string {
		tok, err := key.Mint(kind, subject, tenants, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return "Bearer " + tok
	}
	acme := mint(auth.KindEngine, "engine-0", "acme")
	cases := []struct {
		name, auth, tenant string
		want               int
	}{
		{"no credential", "", "acme", http.StatusUnauthorized},
		{"a wrong token", "Bearer wrong", "acme", http.StatusUnauthorized},
		{"a service token", mint(auth.KindService, "sender"), "acme", http.StatusForbidden},
		{"an engine token for its tenant", acme, "acme", http.StatusOK},
		{"an engine token for another tenant", acme, "globex", http.StatusForbidden},
		{"an engine token for no tenant it serves", acme, "", http.StatusForbidden},
		{"an engine token of no tenant for no tenant", mint(auth.KindEngine, "engine-1"), "", http.StatusOK},
		{"an engine token of every tenant", mint(auth.KindEngine, "engine-2", auth.AnyTenant), "globex", http.StatusOK},
		{"the operator token", "Bearer test-token", "globex", http.StatusOK},
	}
	toks := tokens(48, 2702)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			headers := map[string]string{}
			if tc.auth != "" {
				headers["Authorization"] = tc.auth
			}
			res := s.postTo(t, "/v1/score", scoreBody(toks, tc.tenant), headers)
			checkScoreResponse(t, res)
			if tc.want == http.StatusOK {
				if res.status != http.StatusOK {
					t.Fatalf("status %d: %s, want 200", res.status, res.body)
				}
				return
			}
			p := res.problem(t, tc.want)
			if tc.want == http.StatusForbidden && tc.tenant != "acme" && !strings.Contains(p.Detail, "tenant") {
				t.Errorf("403 detail %q does not name the tenant", p.Detail)
			}
		})
	}
}

// TestScoreBadInput: a bad score request is a 400 problem naming the
// field, counted as invalid; the store is not asked.
func TestScoreBadInput(t *testing.T) {
	env := servicetest.NewEnv(t)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense)})
	good := func(edit func(m map[string]any)) map[string]any {
		m := map[string]any{"model": "test-model", "block_hashes": []string{"aa01", "bb02", "cc03"}, "num_tokens": 48}
		edit(m)
		return m
	}
	cases := []struct {
		name  string
		body  any
		field string
	}{
		{"no prompt", map[string]any{"model": "test-model"}, "token_ids"},
		{"another model", good(func(m map[string]any) { m["model"] = "other" }), "model"},
		{"a bad tenant", good(func(m map[string]any) { m["tenant"] = "a b" }), "tenant"},
		{"block_hashes without num_tokens", good(func(m map[string]any) { delete(m, "num_tokens") }), "num_tokens"},
		{"too few hashes", good(func(m map[string]any) { m["num_tokens"] = 64 }), "block_hashes"},
		{"a bad hash", good(func(m map[string]any) { m["block_hashes"] = []string{"aa01", "zz", "cc03"} }), "block_hashes[1]"},
		{"an unknown field", good(func(m map[string]any) { m["colour"] = "red" }), "colour"},
		{"num_computed_tokens", good(func(m map[string]any) { m["num_computed_tokens"] = 16 }), "num_computed_tokens"},
		{"kv_transfer_params", good(func(m map[string]any) {
			m["kv_transfer_params"] = map[string]any{"remote_engine_id": "p", "remote_block_table": [][]int{{1}}, "remote_tokens": 16}
		}), "kv_transfer_params"},
		{"load_async", good(func(m map[string]any) { m["load_async"] = true }), "load_async"},
		{"an engine_id too long", good(func(m map[string]any) { m["engine_id"] = strings.Repeat("e", api.MaxIDBytes+1) }), "engine_id"},
	}
	calls, invalid := s.metric(t, `kvmesh_store_op_duration_seconds_count{op="score_exists"}`), s.metric(t, `kvmesh_lookup_scores_total{outcome="invalid"}`)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res := s.postTo(t, "/v1/score", tc.body, nil)
			checkScoreResponse(t, res)
			if p := res.problem(t, http.StatusBadRequest); p.Extras["field"] != tc.field {
				t.Errorf("problem %+v, want field %s", p, tc.field)
			}
		})
	}
	if got := s.metric(t, `kvmesh_lookup_scores_total{outcome="invalid"}`) - invalid; got != float64(len(cases)) {
		t.Errorf("invalid scores counted %v, want %d", got, len(cases))
	}
	if got := s.metric(t, `kvmesh_store_op_duration_seconds_count{op="score_exists"}`) - calls; got != 0 {
		t.Errorf("refused scores made %v store calls, want 0", got)
	}
	// engine_id and request_id are optional, and accepted when given.
	if got := s.score(t, good(func(m map[string]any) { m["engine_id"], m["request_id"] = "engine-0", "r-1" }), nil); got.NumTokens != 48 {
		t.Errorf("score with ids %s, want 48 tokens", asJSON(got))
	}
}

// TestScoreStoreOutage: with the store down a score is a 503 problem with
// Retry-After and the store's status, counted as store_failed — never a
// guessed score; once the store is back the score is answered again.
func TestScoreStoreOutage(t *testing.T) {
	rs := testenv.StartRedis(t)
	env, _ := brokerEnv(t, rs.URL())
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_TIMEOUT": "500ms"})
	toks := tokens(48, 2703)
	seed := newSeeder(t, rs.URL())
	seed.put(t, groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)...)
	if got := s.score(t, scoreBody(toks, ""), nil).Store.HitTokens; got != 32 {
		t.Fatalf("before the outage: hit_tokens %d, want 32", got)
	}
	seed.forget()
	rs.Stop()
	res := s.postTo(t, "/v1/score", scoreBody(toks, ""), nil)
	checkScoreResponse(t, res)
	p := res.problem(t, http.StatusServiceUnavailable)
	if ra := res.header.Get("Retry-After"); ra != "1" || p.Extras["result"] != "store_failed" ||
		(p.Extras["reason"] != "unavailable" && p.Extras["reason"] != "timeout") {
		t.Errorf("Retry-After %q, problem %+v; want 1, result store_failed and reason unavailable or timeout", ra, p)
	}
	if got := s.metric(t, `kvmesh_lookup_scores_total{outcome="store_failed"}`); got != 1 {
		t.Errorf("store_failed scores counted %v, want 1", got)
	}
	rs = testenv.RestartRedis(t, rs)
	seed = newSeeder(t, rs.URL())
	seed.put(t, groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0)...)
	eventually(t, "scores answered again after the store came back", func() bool {
		res := s.postTo(t, "/v1/score", scoreBody(toks, ""), nil)
		return res.status == http.StatusOK
	})
	if got := s.score(t, scoreBody(toks, ""), nil).Store.HitTokens; got != 16 {
		t.Errorf("after the outage: hit_tokens %d, want 16", got)
	}
}
