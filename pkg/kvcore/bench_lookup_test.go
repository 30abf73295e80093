package kvcore

import "testing"

// BenchmarkLookupPlan128K3Group plans and resolves the lookup of a
// 131072-token prompt on the full-swa-mamba preset: once with every key
// present, once with a full-attention chunk missing in the middle.
func BenchmarkLookupPlan128K3Group(b *testing.B) {
	const numTokens = 131072
	m, err := Preset("full-swa-mamba")
	if err != nil {
		b.Fatal(err)
	}
	kb := KeyBuilder{Prefix: "bench", Model: m.Name}
	hashes := promptHashes(m, numTokens, 1)
	p, err := PlanLookup(m, kb, hashes, numTokens)
	if err != nil {
		b.Fatal(err)
	}
	all := make([]bool, len(p.Keys()))
	for i := range all {
		all[i] = true
	}
	hole := append([]bool(nil), all...)
	missing := kb.Key(Rank{}, 0, hashes[numTokens/2/m.HashBlockSize-1])
	for i, k := range p.Keys() {
		if k == missing {
			hole[i] = false
		}
	}
	cases := []struct {
		name    string
		answers []bool
		want    int
	}{
		{"all_present", all, numTokens - m.SchedulerBlockSize()},
		{"miss_in_middle", hole, numTokens/2 - m.SchedulerBlockSize()},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				p, err := PlanLookup(m, kb, hashes, numTokens)
				if err != nil {
					b.Fatal(err)
				}
				if hit, err := p.Resolve(tc.answers); err != nil || hit != tc.want {
					b.Fatalf("Resolve = %d, %v; want %d", hit, err, tc.want)
				}
			}
		})
	}
}

// BenchmarkKey builds one store key with a prefix and a 32-byte hash.
func BenchmarkKey(b *testing.B) {
	kb := KeyBuilder{Prefix: "depA", Model: "full-swa-mamba"}
	h := HashTokens(nil, []uint32{1, 2, 3}, nil)
	r := Rank{TP: 3, PP: 1}
	b.ReportAllocs()
	for b.Loop() {
		_ = kb.Key(r, 2, h)
	}
}

// BenchmarkLookupPlan32K2Group plans the lookup of a 32768-token prompt on
// the hybrid-mla-linear preset (4096 keys), the plan of the lookup
// service's BenchmarkLookup32K2Group, and resolves it with every key present.
func BenchmarkLookupPlan32K2Group(b *testing.B) {
	const numTokens = 32768
	m, err := Preset("hybrid-mla-linear")
	if err != nil {
		b.Fatal(err)
	}
	kb := KeyBuilder{Prefix: "lookupbench", Model: m.Name}
	hashes := promptHashes(m, numTokens, 1)
	p, err := PlanLookup(m, kb, hashes, numTokens)
	if err != nil {
		b.Fatal(err)
	}
	all := make([]bool, len(p.Keys()))
	for i := range all {
		all[i] = true
	}
	want := numTokens - m.SchedulerBlockSize()
	b.ReportAllocs()
	for b.Loop() {
		p, err := PlanLookup(m, kb, hashes, numTokens)
		if err != nil {
			b.Fatal(err)
		}
		if hit, err := p.Resolve(all); err != nil || hit != want {
			b.Fatalf("Resolve = %d, %v; want %d", hit, err, want)
		}
	}
}
