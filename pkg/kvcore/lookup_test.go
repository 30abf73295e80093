package kvcore

import (
	"errors"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
)

// storeFake is an existence-check store for lookup tests: it answers from a
// set of present keys and counts round-trips.
type storeFake struct {
	present map[string]bool
	calls   int
}

func (s *storeFake) exists(keys []string) []bool {
	s.calls++
	out := make([]bool, len(keys))
	for i, k := range keys {
		out[i] = s.present[k]
	}
	return out
}

func TestPlanLookupErrors(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 64, 1)
	cases := []struct {
		name   string
		model  *Model
		hashes []BlockHash
		tokens int
		want   error
	}{
		{"negative tokens", m, hashes, -1, ErrNegativeCount},
		{"short chain", m, hashes[:3], 64, ErrShortHashChain},
		{"empty hash", m, []BlockHash{hashes[0], {}, hashes[2]}, 48, ErrEmptyHash},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if p, err := PlanLookup(tc.model, kb, tc.hashes, tc.tokens); !errors.Is(err, tc.want) {
				t.Fatalf("PlanLookup = %v, %v; want %v", p, err, tc.want)
			}
		})
	}
	var se *SpecError
	if _, err := PlanLookup(lookupModel(16), kb, hashes, 64); !errors.As(err, &se) {
		t.Fatalf("PlanLookup on a model without groups = %v, want *SpecError", err)
	}
	// The chain only has to cover the aligned token count.
	if _, err := PlanLookup(m, kb, hashes[:3], 63); err != nil {
		t.Fatalf("PlanLookup(63 tokens, 3 hashes) = %v, want nil", err)
	}
}

func TestPlanLookupShortPrompt(t *testing.T) {
	m := lookupModel(32, grpFull(32), grpMamba(32))
	p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, nil, 31)
	if err != nil {
		t.Fatalf("PlanLookup: %v", err)
	}
	if len(p.Keys()) != 0 {
		t.Fatalf("%d keys for a prompt shorter than a block, want none", len(p.Keys()))
	}
	if hit, err := p.Resolve(nil); hit != 0 || err != nil {
		t.Fatalf("Resolve = %d, %v; want 0, nil", hit, err)
	}
}

func TestPlanLookupDedupesKeys(t *testing.T) {
	// An engine may supply opaque hashes; equal hashes give equal keys,
	// which are checked once and answer for every chunk that uses them.
	m := lookupModel(16, grpFull(16))
	a, b := BlockHash{0xaa}, BlockHash{0xbb}
	p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, []BlockHash{a, b, a, b}, 65)
	if err != nil {
		t.Fatalf("PlanLookup: %v", err)
	}
	if len(p.Keys()) != 2 {
		t.Fatalf("keys %q, want 2 distinct", p.Keys())
	}
	exists := []bool{p.Keys()[0] == m.Name+"@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@aa", true}
	if !exists[0] {
		t.Fatalf("first key %q is not hash aa's", p.Keys()[0])
	}
	if hit := p.Hit(exists, 64); hit != 64 {
		t.Fatalf("Hit = %d, want 64 (both keys present)", hit)
	}
	if hit := p.Hit([]bool{true, false}, 64); hit != 16 {
		t.Fatalf("Hit = %d, want 16 (hash bb missing)", hit)
	}
}

func TestLookupEveryRank(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpMLA(16))
	m.Parallel = Parallel{TP: 2, PP: 2}
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 64, 2)
	p, err := PlanLookup(m, kb, hashes, 65)
	if err != nil {
		t.Fatalf("PlanLookup: %v", err)
	}
	// full: 4 chunks × 4 ranks; MLA: 4 chunks × 2 ranks (tp_rank 0 only).
	if got := len(p.Keys()); got != 24 {
		t.Fatalf("%d keys, want 24", got)
	}
	store := &storeFake{present: map[string]bool{}}
	for _, k := range p.Keys() {
		store.present[k] = true
	}
	if hit, _ := p.Resolve(store.exists(p.Keys())); hit != 64 {
		t.Fatalf("all present: hit %d, want 64", hit)
	}
	delete(store.present, kb.Key(Rank{TP: 1, PP: 1}, 0, hashes[2]))
	if hit, _ := p.Resolve(store.exists(p.Keys())); hit != 32 {
		t.Fatalf("chunk 2 missing on one rank: hit %d, want 32", hit)
	}
	for _, k := range p.Keys() {
		if parts, _ := ParseKey(k); parts.Group == 1 && parts.Rank.TP != 0 {
			t.Fatalf("MLA key %q outside tp_rank 0", k)
		}
	}
}

func TestResolveAnswerCount(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, promptHashes(m, 48, 1), 48)
	if err != nil {
		t.Fatalf("PlanLookup: %v", err)
	}
	if _, err := p.Resolve([]bool{true, true}); !errors.Is(err, ErrAnswerCount) {
		t.Fatalf("Resolve with 2 answers for 3 keys = %v, want ErrAnswerCount", err)
	}
	// Hit itself treats a missing answer as absent rather than panicking.
	if hit := p.Hit([]bool{true, true}, 48); hit != 32 {
		t.Fatalf("Hit with the third answer missing = %d, want 32", hit)
	}
}

func TestDecide(t *testing.T) {
	cases := []struct {
		name          string
		hit, computed int
		async         bool
		wantNeed      int
		wantSpec      *LoadSpec
		wantAsync     bool
	}{
		{"load", 32, 16, true, 16, &LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}, true},
		{"sync load", 64, 0, false, 64, &LoadSpec{KVPoolCachedTokens: 64}, false},
		{"engine has it all", 32, 32, true, 0, nil, false},
		{"engine has more", 32, 48, true, 0, nil, false},
		{"no hit", 0, 0, true, 0, nil, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			need, spec, async := Decide(tc.hit, tc.computed, tc.async)
			if need != tc.wantNeed || async != tc.wantAsync {
				t.Fatalf("Decide = (%d, %v), want (%d, %v)", need, async, tc.wantNeed, tc.wantAsync)
			}
			if !reflect.DeepEqual(spec, tc.wantSpec) {
				t.Fatalf("Decide spec = %+v, want %+v", spec, tc.wantSpec)
			}
		})
	}
}

// oracleHit is the hit straight from the definition: the longest candidate
// h ≤ limit at which every group finds every chunk it reaches in every rank
// namespace. It also returns every key needed at some candidate.
func oracleHit(t *testing.T, m *Model, kb KeyBuilder, hashes []BlockHash, aligned, limit int, present map[string]bool) (int, map[string]bool) {
	t.Helper()
	sbs := m.SchedulerBlockSize()
	needed := map[string]bool{}
	best := 0
	for h := sbs; h <= aligned; h += sbs {
		ok := true
		for g, grp := range m.Groups {
			for _, c := range Chunks(0, h, grp.BlockSize) {
				if !grp.Reaches(c, h) {
					continue
				}
				for _, r := range m.Namespaces(g) {
					k := kb.Key(r, g, hashes[c.HashIndex(m.HashBlockSize)])
					needed[k] = true
					ok = ok && present[k]
				}
			}
		}
		if ok && h <= limit {
			best = h
		}
	}
	return best, needed
}

// randomModel draws models until one is valid (vLLM refuses a Mamba group
// whose block is not the cache block) and without partial hash hits, whose
// hits TestOracleParityPartial holds to vLLM's fine-grained rules.
func randomModel(rng *rand.Rand) *Model {
	for {
		if m := drawModel(rng); m.Validate() == nil && !m.PartialHashHits() {
			return m
		}
	}
}

func drawModel(rng *rand.Rand) *Model {
	hbs := []int{4, 8, 16}[rng.IntN(3)]
	kinds := []Kind{KindFullAttention, KindMLA, KindSlidingWindow, KindMamba}
	var groups []Group
	for range 1 + rng.IntN(3) {
		g := Group{Kind: kinds[rng.IntN(len(kinds))], BlockSize: hbs * (1 + rng.IntN(4))}
		if g.Kind == KindSlidingWindow {
			g.Window = 1 + rng.IntN(5*g.BlockSize)
		}
		groups = append(groups, g)
	}
	m := lookupModel(hbs, groups...)
	m.Parallel = Parallel{TP: rng.IntN(3), PP: 1 + rng.IntN(2)}
	return m
}

// TestHitProperties checks random models and answers against oracleHit, and
// that Hit is a multiple of the scheduler block size, never above its limit,
// and monotonic in the answers.
func TestHitProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for i := range 400 {
		m := randomModel(rng)
		kb := KeyBuilder{Prefix: "p", Model: m.Name}
		numTokens := rng.IntN(400)
		hashes := promptHashes(m, numTokens, uint32(i))
		p, err := PlanLookup(m, kb, hashes, numTokens)
		if err != nil {
			t.Fatalf("case %d: PlanLookup: %v", i, err)
		}
		density := rng.Float64()
		exists := make([]bool, len(p.Keys()))
		present := map[string]bool{}
		for j, k := range p.Keys() {
			exists[j] = rng.Float64() < density+0.3
			present[k] = exists[j]
		}
		sbs := m.SchedulerBlockSize()
		aligned := numTokens / sbs * sbs
		limit := rng.IntN(numTokens + 1)
		hit := p.Hit(exists, limit)
		want, needed := oracleHit(t, m, kb, hashes, aligned, limit, present)
		if hit != want {
			t.Fatalf("case %d (%+v, %d tokens, limit %d): Hit = %d, oracle %d", i, m, numTokens, limit, hit, want)
		}
		if hit%sbs != 0 || hit > limit || hit < 0 {
			t.Fatalf("case %d: Hit %d not a multiple of %d within [0, %d]", i, hit, sbs, limit)
		}
		if keys := slices.Sorted(maps.Keys(needed)); !slices.Equal(keys, slices.Sorted(slices.Values(p.Keys()))) {
			t.Fatalf("case %d (%+v): plan keys %q, needed %q", i, m, p.Keys(), keys)
		}
		if len(exists) > 0 {
			more := slices.Clone(exists)
			more[rng.IntN(len(more))] = true
			if got := p.Hit(more, limit); got < hit {
				t.Fatalf("case %d: a present key lowered the hit from %d to %d", i, hit, got)
			}
		}
		full, _ := p.Resolve(exists)
		wantFull, _ := oracleHit(t, m, kb, hashes, aligned, numTokens, present)
		if wantFull >= numTokens && wantFull > 0 {
			wantFull, _ = oracleHit(t, m, kb, hashes, aligned, numTokens-1, present)
		}
		if full != wantFull || (numTokens > 0 && full >= numTokens) {
			t.Fatalf("case %d: Resolve = %d, oracle %d (%d tokens)", i, full, wantFull, numTokens)
		}
	}
}

// TestPlanLookupKeysAreKeyBuilders: every plan's keys are exactly
// KeyBuilder.Key's strings of the chain's distinct hashes, in order of
// first appearance, for chains of many repeats and of every hash length,
// and a plan's keys stay intact while later plans reuse the planner's
// scratch space.
func TestPlanLookupKeysAreKeyBuilders(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpMLA(16))
	kb := KeyBuilder{Prefix: "dep", Model: m.Name}
	chain := func(n, size, distinct int) []BlockHash {
		out := make([]BlockHash, n)
		for i := range out {
			h := make(BlockHash, size)
			h[0], h[size-1] = byte(i%distinct), byte(i%distinct*7)
			out[i] = h
		}
		return out
	}
	cases := []struct {
		name    string
		hashes  []BlockHash
		numKeys int
	}{
		{"distinct 32-byte", promptHashes(m, 4096, 3), 2 * 256},
		{"repeats of 1 byte", chain(300, 1, 5), 2 * 5},
		{"repeats of 64 bytes", chain(512, 64, 200), 2 * 200},
		{"all equal", chain(64, 8, 1), 2},
	}
	var plans []*LookupPlan
	var wants [][]string
	for _, tc := range cases {
		p, err := PlanLookup(m, kb, tc.hashes, 16*len(tc.hashes)+1)
		if err != nil {
			t.Fatalf("%s: PlanLookup: %v", tc.name, err)
		}
		var want []string
		for g := range m.Groups {
			seen := map[string]bool{}
			for _, h := range tc.hashes {
				if k := kb.Key(Rank{}, g, h); !seen[k] {
					seen[k] = true
					want = append(want, k)
				}
			}
		}
		if len(want) != tc.numKeys || !slices.Equal(p.Keys(), want) {
			t.Fatalf("%s: %d keys, want %d: %q…", tc.name, len(p.Keys()), len(want), p.Keys()[:min(3, len(p.Keys()))])
		}
		plans, wants = append(plans, p), append(wants, want)
	}
	for i, p := range plans {
		if !slices.Equal(p.Keys(), wants[i]) {
			t.Fatalf("%s: keys changed after later plans", cases[i].name)
		}
	}
}
