package app_test

import (
	"net/http"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestLookupTenantsDoNotShareKeys: the same prompt (the same block hashes)
// stored for tenant acme hits for acme only — not for tenant globex, nor
// for no tenant — in the JSON and the binary body alike; the decision
// answered and published names the tenant; a bad tenant is refused with a
// problem naming the tenant field.
func TestLookupTenantsDoNotShareKeys(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense)})
	decisions := readDecisions(t, env.Brokers)
	toks := tokens(48, 301)
	hashes := kvcore.HashChain(toks, 16, nil)
	seed.put(t, groupKeys(s.keys().ForTenant("acme"), 0, hashes, 0, 1, 2)...)

	hit := expect{external: 32, loadAsync: true, chosen: "store",
		children: []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}
	miss := expect{children: []contract.ChildDecision{store(0, nil)}}
	cases := []struct {
		name, tenant string
		want         expect
	}{
		{"own_tenant_hits", "acme", hit},
		{"other_tenant_misses", "globex", miss},
		{"no_tenant_misses", "", miss},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := body("tenant-"+tc.name, toks, 0)
			if tc.tenant != "" {
				b["tenant"] = tc.tenant
			}
			d := s.lookup(t, b)
			tc.want.check(t, d)
			if d.Tenant != tc.tenant {
				t.Errorf("decision tenant %q, want %q", d.Tenant, tc.tenant)
			}
			if pub, _ := decisions.await(t, "tenant-"+tc.name); pub.Tenant != tc.tenant || pub.ExternalTokens != tc.want.external {
				t.Errorf("published decision tenant %q external %d, want %q %d", pub.Tenant, pub.ExternalTokens, tc.tenant, tc.want.external)
			}
			head := map[string]any{"engine_id": "engine-0", "request_id": "tenant-bin-" + tc.name, "model": "test-model",
				"block_hash_bytes": len(hashes[0]), "num_tokens": 48, "tenant": tc.tenant}
			bin := decodeDecision(t, s.post(t, binaryBody(t, head, hashes), binaryType))
			tc.want.check(t, bin)
			if bin.Tenant != tc.tenant {
				t.Errorf("binary decision tenant %q, want %q", bin.Tenant, tc.tenant)
			}
		})
	}
	for _, bad := range []string{"a b", "a@b", "tenant:x", string(make([]byte, kvcore.MaxTenantBytes+1))} {
		b := body("tenant-bad", toks, 0)
		b["tenant"] = bad
		p := s.post(t, b, nil).problem(t, http.StatusBadRequest)
		if p.Extras["field"] != "tenant" {
			t.Errorf("tenant %q: problem %+v, want field tenant", bad, p)
		}
	}
}
