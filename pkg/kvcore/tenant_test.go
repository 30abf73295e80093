package kvcore

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// TestTenantKeyLayout pins the key format: the empty tenant writes the
// Mooncake keys of before (golden strings), a tenant adds one segment after
// the model name.
func TestTenantKeyLayout(t *testing.T) {
	h := BlockHash{0xde, 0xad, 0xbe, 0xef}
	r := Rank{TP: 1, PCP: 0, DCP: 2, PP: 3}
	cases := []struct {
		name string
		kb   KeyBuilder
		want string
	}{
		{"no tenant", KeyBuilder{Model: "m"}, "m@tp_rank:1@pcp0@dcp2@pp_rank:3@group:4@deadbeef"},
		{"no tenant, prefix", KeyBuilder{Prefix: "dep", Model: "m"}, "dep@m@tp_rank:1@pcp0@dcp2@pp_rank:3@group:4@deadbeef"},
		{"tenant", KeyBuilder{Model: "m", Tenant: "acme"}, "m@tenant:acme@tp_rank:1@pcp0@dcp2@pp_rank:3@group:4@deadbeef"},
		{"tenant, prefix", KeyBuilder{Prefix: "dep", Model: "m", Tenant: "A.b_c-9"}, "dep@m@tenant:A.b_c-9@tp_rank:1@pcp0@dcp2@pp_rank:3@group:4@deadbeef"},
		{"ForTenant", KeyBuilder{Prefix: "dep", Model: "m"}.ForTenant("t1"), "dep@m@tenant:t1@tp_rank:1@pcp0@dcp2@pp_rank:3@group:4@deadbeef"},
		{"ForTenant empty", KeyBuilder{Model: "m", Tenant: "t1"}.ForTenant(""), "m@tp_rank:1@pcp0@dcp2@pp_rank:3@group:4@deadbeef"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.kb.Key(r, 4, h); got != tc.want {
				t.Fatalf("Key = %q, want %q", got, tc.want)
			}
			if got := tc.kb.KeyHex(r, 4, "deadbeef"); got != tc.want {
				t.Fatalf("KeyHex = %q, want %q", got, tc.want)
			}
			if got := tc.kb.Namespace(r, 4) + "@deadbeef"; got != tc.want {
				t.Fatalf("Namespace+hash = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestTenantsNeverShareKeys: identical hashes under two tenants (and under
// no tenant) give three different keys, on every rank and group.
func TestTenantsNeverShareKeys(t *testing.T) {
	hashes := promptHashes(lookupModel(16, grpFull(16)), 64, 5)
	base := KeyBuilder{Prefix: "dep", Model: "m"}
	for g, h := range hashes {
		for _, r := range []Rank{{}, {TP: 3, PP: 1}} {
			seen := map[string]string{}
			for _, tenant := range []string{"", "a", "b", "ab", "a.b"} {
				k := base.ForTenant(tenant).Key(r, g, h)
				if other, dup := seen[k]; dup {
					t.Fatalf("tenants %q and %q share key %q", other, tenant, k)
				}
				seen[k] = tenant
			}
		}
	}
}

func TestValidateTenant(t *testing.T) {
	cases := []struct {
		tenant string
		ok     bool
	}{
		{"", true},
		{"a", true},
		{"Acme.Corp_1-x", true},
		{strings.Repeat("t", MaxTenantBytes), true},
		{strings.Repeat("t", MaxTenantBytes+1), false},
		{"a@b", false},
		{"a b", false},
		{"a:b", false},
		{"a/b", false},
		{"ä", false},
		{"a\n", false},
		{"a\x00", false},
	}
	for _, tc := range cases {
		err := ValidateTenant(tc.tenant)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateTenant(%q) = %v, want ok %v", tc.tenant, err, tc.ok)
		}
		if !tc.ok && !errors.Is(err, ErrBadTenant) {
			t.Errorf("ValidateTenant(%q) = %v, want ErrBadTenant", tc.tenant, err)
		}
		kb := KeyBuilder{Model: "m", Tenant: tc.tenant}
		if err := kb.Validate(); (err == nil) != tc.ok || (!tc.ok && !errors.Is(err, ErrBadTenant)) {
			t.Errorf("KeyBuilder{Tenant: %q}.Validate() = %v, want ok %v", tc.tenant, err, tc.ok)
		}
	}
}

// TestModelMayNotLookLikeATenant: a model name starting with the tenant
// tag would make keys ambiguous, so the builder and the parser refuse it.
func TestModelMayNotLookLikeATenant(t *testing.T) {
	if err := (KeyBuilder{Prefix: "dep", Model: "tenant:x"}).Validate(); !errors.Is(err, ErrBadKeyPrefix) {
		t.Fatalf("Validate = %v, want ErrBadKeyPrefix", err)
	}
	if _, err := ParseKey("tenant:x@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab"); !errors.Is(err, ErrBadKey) {
		t.Fatalf("ParseKey = %v, want ErrBadKey", err)
	}
}

func TestTenantKeyRoundTrip(t *testing.T) {
	hashes := promptHashes(lookupModel(16, grpFull(16)), 48, 7)
	builders := []KeyBuilder{
		{Model: "m"}, {Model: "m", Tenant: "acme"}, {Prefix: "dep", Model: "m"}, {Prefix: "dep", Model: "m", Tenant: "x-1.2_3"},
		{Prefix: "tenant:p", Model: "m", Tenant: "t"}, {Prefix: "tenant:p", Model: "m"},
	}
	for _, kb := range builders {
		for _, r := range []Rank{{}, {TP: 2, PCP: 1, DCP: 1, PP: 4}} {
			for g, h := range hashes {
				key := kb.Key(r, g, h)
				p, err := ParseKey(key)
				if err != nil {
					t.Fatalf("ParseKey(%q): %v", key, err)
				}
				if p.Prefix != kb.Prefix || p.Model != kb.Model || p.Tenant != kb.Tenant || p.Rank != r || p.Group != g || !bytes.Equal(p.Hash, h) {
					t.Fatalf("ParseKey(%q) = %+v, want builder %+v", key, p, kb)
				}
				if p.Key() != key {
					t.Fatalf("KeyParts.Key() = %q, want %q", p.Key(), key)
				}
				own, ok, err := KeyBuilder{Prefix: kb.Prefix, Model: kb.Model}.ParseOwn(key)
				if err != nil || !ok || own.Tenant != kb.Tenant {
					t.Fatalf("ParseOwn(%q) = %+v, %v, %v: a deployment owns every tenant's keys", key, own, ok, err)
				}
			}
		}
	}
}

func TestParseKeyRejectsBadTenants(t *testing.T) {
	const tail = "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
	for name, key := range map[string]string{
		"empty tenant":         "m@tenant:" + tail,
		"empty tenant, prefix": "dep@m@tenant:" + tail,
		"bad tenant byte":      "m@tenant:a:b" + tail,
		"long tenant":          "m@tenant:" + strings.Repeat("t", MaxTenantBytes+1) + tail,
		"untagged tenant":      "dep@m@acme" + tail,
		"ten fields":           "a@b@m@tenant:t" + tail,
	} {
		t.Run(name, func(t *testing.T) {
			if p, err := ParseKey(key); !errors.Is(err, ErrBadKey) {
				t.Fatalf("ParseKey(%q) = %+v, %v; want ErrBadKey", key, p, err)
			}
		})
	}
}

// TestPlansUseTheTasksTenant: PlanSend, PlanLoad and PlanLookup key every
// block in the task's (or builder's) tenant's key space, and refuse a bad
// tenant.
func TestPlansUseTheTasksTenant(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	kb := KeyBuilder{Prefix: "dep", Model: m.Name}
	hashes := promptHashes(m, 64, 11)
	save := &SaveTask{
		Model: m.Name, Tenant: "acme", Start: 0, End: 64,
		BlockTable: BlockTable{{1, 2, 3, 4}}, BlockHashes: hexHashes(hashes),
		Groups: m.SaveGroups(0, 64),
	}
	items, err := PlanSend(m, kb, save, 0, Rank{})
	if err != nil || len(items) != 4 {
		t.Fatalf("PlanSend = %d items, %v", len(items), err)
	}
	for i, it := range items {
		if want := kb.ForTenant("acme").Key(Rank{}, 0, hashes[i]); it.Key != want {
			t.Fatalf("PlanSend item %d key %q, want %q", i, it.Key, want)
		}
	}
	load := &LoadTask{Model: m.Name, Tenant: "acme", Start: 0, End: 64,
		BlockTable: BlockTable{{1, 2, 3, 4}}, BlockHashes: hexHashes(hashes), Groups: m.LoadGroups(0, 64)}
	litems, err := PlanLoad(m, kb.ForTenant("other"), load, Rank{})
	if err != nil || len(litems) != 4 {
		t.Fatalf("PlanLoad = %d items, %v", len(litems), err)
	}
	for i, it := range litems {
		if it.Key != items[i].Key {
			t.Fatalf("PlanLoad item %d key %q, want the save's %q", i, it.Key, items[i].Key)
		}
	}
	plan, err := PlanLookup(m, kb.ForTenant("acme"), hashes, 64)
	if err != nil {
		t.Fatalf("PlanLookup: %v", err)
	}
	for _, k := range plan.Keys() {
		if !strings.HasPrefix(k, "dep@m@tenant:acme@") && !strings.HasPrefix(k, "dep@"+m.Name+"@tenant:acme@") {
			t.Fatalf("lookup key %q is not in tenant acme's key space", k)
		}
	}
	save.Tenant, load.Tenant = "bad tenant", "bad tenant"
	if _, err := PlanSend(m, kb, save, 0, Rank{}); !errors.Is(err, ErrBadTenant) {
		t.Fatalf("PlanSend with a bad tenant = %v, want ErrBadTenant", err)
	}
	if _, err := PlanLoad(m, kb, load, Rank{}); !errors.Is(err, ErrBadTenant) {
		t.Fatalf("PlanLoad with a bad tenant = %v, want ErrBadTenant", err)
	}
	if _, err := PlanLookup(m, kb.ForTenant("bad tenant"), hashes, 64); !errors.Is(err, ErrBadTenant) {
		t.Fatalf("PlanLookup with a bad tenant = %v, want ErrBadTenant", err)
	}
}
