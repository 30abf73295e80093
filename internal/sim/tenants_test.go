package sim

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestWorkloadTenants: conversations get tenants round robin; with 0 or 1
// tenants nothing changes (the same conversations, no tenant), and a
// prefix that makes bad tenant names is refused.
func TestWorkloadTenants(t *testing.T) {
	w := Workload{Requests: 12, Turns: Range{2, 2}, SystemPrompts: 2, SystemTokens: Range{8, 8}, UserTokens: Range{4, 8},
		OutputTokens: Range{2, 4}, Seed: 7, Vocab: 100}
	plain, err := Generate(w)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{0, 1} {
		w.Tenants = n
		got, err := Generate(w)
		if err != nil || !reflect.DeepEqual(got, plain) {
			t.Fatalf("tenants %d changed the workload (%v)", n, err)
		}
	}
	w.Tenants = 3
	got, err := Generate(w)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range got {
		if want := TenantName("", i%3); c.Tenant != want {
			t.Fatalf("conversation %d tenant %q, want %q", i, c.Tenant, want)
		}
		if !reflect.DeepEqual(c.Turns, plain[i].Turns) || !reflect.DeepEqual(c.System, plain[i].System) {
			t.Fatalf("conversation %d: tenants changed its prompts", i)
		}
	}
	w.TenantPrefix = "acme."
	if got, _ := Generate(w); got[1].Tenant != "acme.1" {
		t.Fatalf("tenant %q, want acme.1", got[1].Tenant)
	}
	for _, bad := range []string{"a b", "a@", strings.Repeat("p", kvcore.MaxTenantBytes)} {
		w.TenantPrefix = bad
		if err := w.Validate(); !errors.Is(err, ErrWorkload) || !errors.Is(err, kvcore.ErrBadTenant) {
			t.Errorf("prefix %q: %v, want ErrWorkload and ErrBadTenant", bad, err)
		}
	}
	w.TenantPrefix, w.Tenants = "", -1
	if err := w.Validate(); !errors.Is(err, ErrWorkload) {
		t.Errorf("tenants -1: %v, want ErrWorkload", err)
	}
}

// TestPrefixCacheKeepsTenantsApart: the engine's prefix-cache key of a
// block is its hash for no tenant (as before) and differs per tenant.
func TestPrefixCacheKeepsTenantsApart(t *testing.T) {
	if got := cacheKey("", "ab12"); got != "ab12" {
		t.Fatalf("no tenant: %q", got)
	}
	if cacheKey("a", "ab12") == cacheKey("b", "ab12") || cacheKey("a", "ab12") == "ab12" {
		t.Fatal("tenants share a prefix-cache key")
	}
}

// TestTenantCounts: admissions count per tenant, store loads of first
// turns apart.
func TestTenantCounts(t *testing.T) {
	st := newStats()
	st.update(func(s *stats) {
		s.tenantLocked("a", true, 64, 0, 32, "store")
		s.tenantLocked("a", false, 96, 16, 48, "store")
		s.tenantLocked("b", true, 64, 0, 0, "")
		s.tenantLocked("b", false, 64, 0, 32, "pd")
	})
	got := st.tenantsLocked(map[string]int{"a": 5})
	want := []TenantCounts{
		{Tenant: "a", Admissions: 2, FirstTurnAdmissions: 1, PromptTokens: 160, LocalHitTokens: 16, StoreLoadedTokens: 80, FirstTurnStoreLoadedTokens: 32, StoredKeys: 5},
		{Tenant: "b", Admissions: 2, FirstTurnAdmissions: 1, PromptTokens: 128},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("tenants %+v\nwant %+v", got, want)
	}
	if newStats().tenantsLocked(nil) != nil {
		t.Fatal("a run without tenants lists tenants")
	}
}

// TestLedgerTenantChecks: a save task or a stored key of another tenant
// than its request's is a ledger difference; stored keys are counted per
// tenant.
func TestLedgerTenantChecks(t *testing.T) {
	f := newLedgerFixture(t)
	f.l.tenants = map[string]string{"run-1": "a", "run-2": "b"}
	f.l.expectSave("e", "run-1", span{0, 16})
	task := f.task("t1", "run-1", 0, 16)
	task.TaskID, task.RequestID, task.Tenant = "t2", "run-2", "b"
	f.l.saveTask(Record{Key: "run-2", Value: mustJSON(task)})
	kbA := kvcore.KeysOf(f.m).ForTenant("a")
	h, _ := kvcore.ParseBlockHash(f.hashes[0])
	for _, rec := range storedRecords(t, "e", "run-1", []string{kbA.Key(kvcore.Rank{}, 0, h)}) {
		f.l.kvEvent(rec)
	}
	kbB := kbA.ForTenant("b")
	for _, rec := range storedRecords(t, "e", "run-2", []string{kbB.Key(kvcore.Rank{}, 0, h), kbA.Key(kvcore.Rank{}, 1, h)}) {
		f.l.kvEvent(rec)
	}
	rep := f.l.report()
	var problems []string
	for _, d := range rep.Differences {
		if strings.Contains(d.Problem, "tenant") {
			problems = append(problems, d.RequestID+": "+d.Problem)
		}
	}
	// t1 has no tenant (request run-1's is a); run-2 stored a key of tenant a.
	if len(problems) != 2 || !strings.HasPrefix(problems[0], "run-1: save task of tenant \"\"") || !strings.Contains(problems[1], "of tenant \"a\", the request's tenant is \"b\"") {
		t.Fatalf("tenant differences %q", problems)
	}
	if got := f.l.storedByTenant(); got["a"] != 2 || got["b"] != 1 {
		t.Fatalf("stored by tenant %v", got)
	}
}
