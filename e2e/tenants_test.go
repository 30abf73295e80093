package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// tenantWorkload is two conversations of two turns that open with one
// shared system prompt: with two tenants, conversation 0 is tenant
// {prefix}0 and conversation 1 tenant {prefix}1, and their first turns
// share a long prefix of identical block hashes.
func tenantWorkload(prefix string) sim.Workload {
	return sim.Workload{
		Requests: 4, Turns: sim.Range{Min: 2, Max: 2}, SystemPrompts: 1,
		SystemTokens: sim.Range{Min: 160, Max: 160}, UserTokens: sim.Range{Min: 16, Max: 32},
		OutputTokens: sim.Range{Min: 4, Max: 8}, ThinkTime: 20 * time.Millisecond,
		Seed: 90210, Vocab: 32000, Tenants: 2, TenantPrefix: prefix,
	}
}

// TestTenantsDoNotShareKV plays one workload three times through the real
// mesh, with one salt (so identical prompts have identical block hashes):
// as tenants a0/a1, then as tenants b0/b1, then again as a0/a1 on a fresh
// engine. Every run is clean (every loaded byte right, the save ledger
// balanced with no key or task of the wrong tenant, every stored value
// right). The b tenants' first turns get no store hit from the a tenants'
// saves of the very same prompts (their lookup decisions name their tenant
// and the store child answers 0), while the a tenants' replay loads its
// own saves; every key the runs stored carries its tenant's segment and is
// in Redis.
func TestTenantsDoNotShareKV(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	first := simConfig(t, s, false, tenantWorkload("a"))
	runA := runTenants(ctx, t, first)
	for _, tc := range runA.Tenants {
		if tc.FirstTurnStoreLoadedTokens != 0 || tc.StoredKeys == 0 {
			t.Fatalf("run a, tenant %s: %d first-turn tokens loaded from the store (want 0: nothing of its own stored yet), %d keys stored (want some)",
				tc.Tenant, tc.FirstTurnStoreLoadedTokens, tc.StoredKeys)
		}
	}

	other := simConfig(t, s, false, tenantWorkload("b"))
	other.Salt = first.Salt
	runB := runTenants(ctx, t, other)
	for _, tc := range runB.Tenants {
		if tc.FirstTurnAdmissions == 0 || tc.FirstTurnStoreLoadedTokens != 0 {
			t.Fatalf("run b, tenant %s: %d first-turn admissions, %d first-turn tokens loaded from the store; want some admissions and no tokens of tenant a's saves",
				tc.Tenant, tc.FirstTurnAdmissions, tc.FirstTurnStoreLoadedTokens)
		}
	}
	firstTurns := 0
	for _, d := range runDecisions(ctx, t, s, other.RunTag) {
		if want := tenantOfRequest(d.RequestID, "b"); d.Tenant != want {
			t.Fatalf("decision of %s names tenant %q, want %q", d.RequestID, d.Tenant, want)
		}
		if !strings.HasSuffix(d.RequestID, "-t00") {
			continue
		}
		firstTurns++
		for _, c := range d.Children {
			if c.Name == "store" && (c.Tokens != 0 || c.Spec != nil) {
				t.Fatalf("first turn %s of tenant %s: the store child answered %d tokens (spec %+v) from another tenant's keys", d.RequestID, d.Tenant, c.Tokens, c.Spec)
			}
		}
	}
	if firstTurns == 0 {
		t.Fatal("no lookup decision of run b's first turns")
	}

	replay := simConfig(t, s, false, tenantWorkload("a"))
	replay.Salt = first.Salt
	runA2 := runTenants(ctx, t, replay)
	for _, tc := range runA2.Tenants {
		if tc.FirstTurnStoreLoadedTokens == 0 {
			t.Fatalf("replay of tenant %s: no first-turn tokens loaded from the store; want its own saves of run a loaded", tc.Tenant)
		}
	}
	checkTenantKeys(ctx, t, s, []string{first.RunTag, other.RunTag, replay.RunTag})
}

// runTenants runs cfg, requires a clean report and one entry per tenant.
func runTenants(ctx context.Context, t *testing.T, cfg sim.Config) *sim.Report {
	t.Helper()
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if rep.Verification.Mismatched != 0 || len(rep.Tenants) != cfg.Workload.Tenants || rep.Stored == nil || rep.Stored.Gone != 0 {
		t.Fatalf("run %s: %d mismatched blocks, tenants %+v, stored check %+v; want none, %d tenants, every stored key in the store",
			cfg.RunTag, rep.Verification.Mismatched, rep.Tenants, rep.Stored, cfg.Workload.Tenants)
	}
	return rep
}

// tenantOfRequest is the tenant of a run request {tag}-c{conv}-t{turn} of
// tenantWorkload(prefix): conversation i is tenant prefix + i mod 2.
func tenantOfRequest(requestID, prefix string) string {
	i := strings.LastIndex(requestID, "-c")
	if i < 0 || i+6 > len(requestID) {
		return ""
	}
	conv := requestID[i+2 : i+6]
	last := conv[len(conv)-1] - '0'
	return sim.TenantName(prefix, int(last%2))
}

// runDecisions are the lookup decisions of the run tagged tag.
func runDecisions(ctx context.Context, t *testing.T, s *stack, tag string) []contract.LookupDecision {
	t.Helper()
	var out []contract.LookupDecision
	for _, d := range lookupDecisions(ctx, t, s) {
		if strings.HasPrefix(d.RequestID, tag+"-") {
			out = append(out, d)
		}
	}
	return out
}

// checkTenantKeys: every key the runs' saves stored (their BlockStored
// records) is in its request's tenant's key space, the record names the
// tenant, and the key is in Redis.
func checkTenantKeys(ctx context.Context, t *testing.T, s *stack, tags []string) {
	t.Helper()
	recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicKVEvents)
	if err != nil {
		t.Fatal(err)
	}
	prefixes := map[string]string{tags[0]: "a", tags[1]: "b", tags[2]: "a"}
	var keys []string
	perTenant := map[string]int{}
	for _, rec := range recs {
		ev, err := contract.DecodeKVEventRecord(rec.Value, rec.Headers)
		if err != nil || ev.Kind() != contract.BlockStored {
			continue
		}
		i := strings.LastIndex(ev.RequestID, "-c") // a run tag may hold "-c" itself
		if i < 0 {
			continue
		}
		prefix, ours := prefixes[ev.RequestID[:i]]
		if !ours {
			continue
		}
		want := tenantOfRequest(ev.RequestID, prefix)
		if ev.Tenant != want {
			t.Fatalf("BlockStored record of %s names tenant %q, want %q", ev.RequestID, ev.Tenant, want)
		}
		for _, k := range ev.Keys() {
			p, err := kvcore.ParseKey(k)
			if err != nil || p.Tenant != want || !strings.Contains(k, "@tenant:"+want+"@") {
				t.Fatalf("stored key %q of %s: tenant %q (%v), want %q", k, ev.RequestID, p.Tenant, err, want)
			}
			keys = append(keys, k)
			perTenant[want]++
		}
	}
	for _, tenant := range []string{"a0", "a1", "b0", "b1"} {
		if perTenant[tenant] == 0 {
			t.Fatalf("no stored key of tenant %s (per tenant: %v)", tenant, perTenant)
		}
	}
	st, err := kvstore.NewRedis(ctx, s.redisURL, kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	exists, err := st.Exists(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range keys {
		if !exists[i] {
			t.Fatalf("stored key %q is not in Redis", k)
		}
	}
	t.Logf("%d stored keys, per tenant %v, all in Redis under their tenant's segment", len(keys), perTenant)
}
