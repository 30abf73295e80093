package kvcore

import "testing"

// BenchmarkLookupPlan128K3Group plans and resolves the lookup of a
// 131072-token prompt on the full-swa-mamba preset: once with every key
// present, once with a full-attention chunk missing in the middle.
func BenchmarkLookupPlan128K3Group(b *testing.B) {
	const numTokens = 131072
	m, kb, hashes, all := lookupBenchSetup(b, "full-swa-mamba", "bench", numTokens)
	p, err := PlanLookup(m, kb, hashes, numTokens)
	if err != nil {
		b.Fatal(err)
	}
	hole := append([]bool(nil), all...)
	missing := kb.Key(Rank{}, 0, hashes[numTokens/2/m.HashBlockSize-1])
	for i, k := range p.Keys() {
		if k == missing {
			hole[i] = false
		}
	}
	b.Run("all_present", func(b *testing.B) {
		benchPlanResolve(b, m, kb, hashes, numTokens, all, numTokens-m.SchedulerBlockSize())
	})
	b.Run("miss_in_middle", func(b *testing.B) {
		benchPlanResolve(b, m, kb, hashes, numTokens, hole, numTokens/2-m.SchedulerBlockSize())
	})
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
	m, kb, hashes, all := lookupBenchSetup(b, "hybrid-mla-linear", "lookupbench", numTokens)
	benchPlanResolve(b, m, kb, hashes, numTokens, all, numTokens-m.SchedulerBlockSize())
}

// lookupBenchSetup returns preset's model, a key builder with prefix, the
// hashes of a numTokens prompt and an all-present answer for its plan.
func lookupBenchSetup(b *testing.B, preset, prefix string, numTokens int) (*Model, KeyBuilder, []BlockHash, []bool) {
	b.Helper()
	m, err := Preset(preset)
	if err != nil {
		b.Fatal(err)
	}
	kb := KeyBuilder{Prefix: prefix, Model: m.Name}
	hashes := promptHashes(m, numTokens, 1)
	p, err := PlanLookup(m, kb, hashes, numTokens)
	if err != nil {
		b.Fatal(err)
	}
	all := make([]bool, len(p.Keys()))
	for i := range all {
		all[i] = true
	}
	return m, kb, hashes, all
}

// benchPlanResolve times planning the lookup and resolving it with answers,
// checking the hit is want.
func benchPlanResolve(b *testing.B, m *Model, kb KeyBuilder, hashes []BlockHash, numTokens int, answers []bool, want int) {
	b.ReportAllocs()
	for b.Loop() {
		p, err := PlanLookup(m, kb, hashes, numTokens)
		if err != nil {
			b.Fatal(err)
		}
		if hit, err := p.Resolve(answers); err != nil || hit != want {
			b.Fatalf("Resolve = %d, %v; want %d", hit, err, want)
		}
	}
}
