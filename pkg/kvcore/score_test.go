package kvcore

import (
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"
)

// held is a set of blocks a store holds of one group: the blocks ending at
// ends (keyed by the hash at each end), in the group's namespace rank (-1:
// in every namespace of the group).
type held struct {
	group, rank int
	ends        []int
}

// heldKeys returns the store keys of hs for a prompt's hashes.
func heldKeys(m *Model, kb KeyBuilder, hashes []BlockHash, hs []held) map[string]bool {
	out := map[string]bool{}
	for _, h := range hs {
		for i, r := range m.Namespaces(h.group) {
			if h.rank >= 0 && h.rank != i {
				continue
			}
			for _, end := range h.ends {
				out[kb.Key(r, h.group, hashes[end/m.HashBlockSize-1])] = true
			}
		}
	}
	return out
}

// gs is a GroupScore of group g.
func gs(g int, k Kind, bs, prefix, usable int) GroupScore {
	return GroupScore{Group: g, Kind: k, BlockSize: bs, PrefixTokens: prefix, UsableTokens: usable}
}

func withTP(m *Model, tp int) *Model {
	m.Parallel.TP = tp
	return m
}

func TestScore(t *testing.T) {
	all := -1
	cases := []struct {
		name     string
		model    *Model
		tokens   int
		held     []held
		hit, any int
		groups   []GroupScore
	}{
		{"full attention only: a prefix held", lookupModel(16, grpFull(16)), 64,
			[]held{{0, all, []int{16, 32, 48}}}, 48, 48,
			[]GroupScore{gs(0, KindFullAttention, 16, 48, 48)}},
		{"full attention only: the whole prompt held, hit cut by the full-hit rule", lookupModel(16, grpFull(16)), 64,
			[]held{{0, all, []int{16, 32, 48, 64}}}, 48, 64,
			[]GroupScore{gs(0, KindFullAttention, 16, 64, 64)}},
		{"full attention only: a gap ends the prefix", lookupModel(16, grpFull(16)), 64,
			[]held{{0, all, []int{16, 48}}}, 16, 16,
			[]GroupScore{gs(0, KindFullAttention, 16, 16, 16)}},
		{"nothing held", lookupModel(16, grpFull(16), grpSWA(16, 32)), 64,
			nil, 0, 0,
			[]GroupScore{gs(0, KindFullAttention, 16, 0, 0), gs(1, KindSlidingWindow, 16, 0, 0)}},
		{"hybrid full + sliding window: the window is missing", lookupModel(16, grpFull(16), grpSWA(16, 32)), 64,
			[]held{{0, all, []int{16, 32, 48, 64}}, {1, all, []int{16}}}, 16, 64,
			[]GroupScore{gs(0, KindFullAttention, 16, 64, 64), gs(1, KindSlidingWindow, 16, 16, 16)}},
		{"hybrid full + sliding window: only the window before the hit held", lookupModel(16, grpFull(16), grpSWA(16, 32)), 64,
			[]held{{0, all, []int{16, 32, 48, 64}}, {1, all, []int{32, 48}}}, 48, 64,
			[]GroupScore{gs(0, KindFullAttention, 16, 64, 64), gs(1, KindSlidingWindow, 16, 0, 48)}},
		{"hybrid: groups holding complementary blocks fold into a longer prefix", lookupModel(16, grpFull(16), grpSWA(16, 16)), 64,
			[]held{{0, all, []int{16}}, {1, all, []int{32, 48}}}, 0, 48,
			[]GroupScore{gs(0, KindFullAttention, 16, 16, 16), gs(1, KindSlidingWindow, 16, 0, 48)}},
		{"hybrid of block sizes 32 and 8", lookupModel(8, grpFull(32), grpSWA(8, 8)), 64,
			[]held{{0, all, []int{32, 64}}, {1, all, []int{32, 64}}}, 32, 64,
			[]GroupScore{gs(0, KindFullAttention, 32, 64, 64), gs(1, KindSlidingWindow, 8, 0, 64)}},
		{"mamba: only the state at the hit", lookupModel(16, grpFull(16), grpMamba(16)), 64,
			[]held{{0, all, []int{16, 32, 48, 64}}, {1, all, []int{32}}}, 32, 64,
			[]GroupScore{gs(0, KindFullAttention, 16, 64, 64), gs(1, KindMamba, 16, 0, 32)}},
		{"mamba under partial hash hits: a state inside a block", lookupModel(16, grpFull(32), grpMamba(32)), 64,
			[]held{{0, all, []int{32, 64}}, {1, all, []int{48}}}, 48, 64,
			[]GroupScore{gs(0, KindFullAttention, 32, 64, 64), gs(1, KindMamba, 32, 0, 48)}},
		{"full attention under partial hash hits: a sub-block tail", lookupModel(16, grpFull(32), grpMamba(32)), 64,
			[]held{{0, all, []int{32, 48}}, {1, all, []int{48}}}, 48, 32,
			[]GroupScore{gs(0, KindFullAttention, 32, 32, 48), gs(1, KindMamba, 32, 0, 48)}},
		{"MLA: one namespace for every TP rank", withTP(lookupModel(16, grpMLA(16)), 2), 48,
			[]held{{0, all, []int{16, 32}}}, 32, 32,
			[]GroupScore{gs(0, KindMLA, 16, 32, 32)}},
		{"TP namespaces: rank 1 lacks a chunk", withTP(lookupModel(16, grpFull(16)), 2), 64,
			[]held{{0, 0, []int{16, 32, 48}}, {0, 1, []int{16, 48}}}, 16, 16,
			[]GroupScore{gs(0, KindFullAttention, 16, 16, 16)}},
		{"a prompt shorter than a block", lookupModel(16, grpFull(16)), 15,
			nil, 0, 0,
			[]GroupScore{gs(0, KindFullAttention, 16, 0, 0)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kb := KeyBuilder{Model: tc.model.Name, Tenant: "acme"}
			hashes := promptHashes(tc.model, tc.tokens, 7)
			p, err := PlanScore(tc.model, kb, hashes, tc.tokens)
			if err != nil {
				t.Fatal(err)
			}
			present := heldKeys(tc.model, kb, hashes, tc.held)
			got, err := p.Score((&storeFake{present: present}).exists(p.Keys()))
			if err != nil {
				t.Fatal(err)
			}
			want := Score{HitTokens: tc.hit, AnyGroupPrefixTokens: tc.any, Groups: tc.groups}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("Score =\n%+v, want\n%+v", got, want)
			}
			checkLookupAgrees(t, tc.model, kb, hashes, tc.tokens, present, got.HitTokens)
		})
	}
}

// checkLookupAgrees: the score's hit is the lookup's, from the same store.
func checkLookupAgrees(t *testing.T, m *Model, kb KeyBuilder, hashes []BlockHash, tokens int, present map[string]bool, hit int) {
	t.Helper()
	lp, err := PlanLookup(m, kb, hashes, tokens)
	if err != nil {
		t.Fatal(err)
	}
	want, err := lp.Resolve((&storeFake{present: present}).exists(lp.Keys()))
	if err != nil {
		t.Fatal(err)
	}
	if hit != want {
		t.Fatalf("score hit %d, lookup hit %d", hit, want)
	}
}

// TestScorePresence: scoring from per-block presence (an engine's KV
// events) gives what scoring the store holding the same blocks gives.
func TestScorePresence(t *testing.T) {
	cases := []struct {
		name   string
		model  *Model
		tokens int
		held   []held
	}{
		{"hybrid full + sliding window", lookupModel(16, grpFull(16), grpSWA(16, 32)), 80, []held{{0, -1, []int{16, 32, 48, 64}}, {1, -1, []int{32, 48, 80}}}},
		{"mamba under partial hash hits", lookupModel(16, grpFull(32), grpMamba(32)), 64, []held{{0, -1, []int{32, 64}}, {1, -1, []int{48}}}},
		{"TP 2 full attention", withTP(lookupModel(16, grpFull(16)), 2), 64, []held{{0, -1, []int{16, 32}}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kb := KeyBuilder{Model: tc.model.Name}
			hashes := promptHashes(tc.model, tc.tokens, 9)
			p, err := PlanScore(tc.model, kb, hashes, tc.tokens)
			if err != nil {
				t.Fatal(err)
			}
			want, err := p.Score((&storeFake{present: heldKeys(tc.model, kb, hashes, tc.held)}).exists(p.Keys()))
			if err != nil {
				t.Fatal(err)
			}
			blocks := map[int]map[string]bool{}
			for _, h := range tc.held {
				blocks[h.group] = map[string]bool{}
				for _, end := range h.ends {
					blocks[h.group][hashes[end/tc.model.HashBlockSize-1].Hex()] = true
				}
			}
			got := p.ScorePresence(func(g int, h BlockHash) bool { return blocks[g][h.Hex()] })
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("ScorePresence =\n%+v, Score =\n%+v", got, want)
			}
			if want.HitTokens == 0 && want.AnyGroupPrefixTokens == 0 {
				t.Fatal("the case scores nothing; it tests nothing")
			}
		})
	}
}

func TestPlanScoreKeys(t *testing.T) {
	m := withTP(lookupModel(16, grpFull(16), grpSWA(16, 16)), 2)
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 64, 3)
	p, err := PlanScore(m, kb, hashes, 64)
	if err != nil {
		t.Fatal(err)
	}
	// Every block of both groups in both namespaces, the lookup's keys
	// among them.
	if got := len(p.Keys()); got != 2*2*4 {
		t.Fatalf("%d keys, want 16", got)
	}
	seen := map[string]bool{}
	for _, k := range p.Keys() {
		if seen[k] {
			t.Fatalf("key %s planned twice", k)
		}
		seen[k] = true
	}
	lp, err := PlanLookup(m, kb, hashes, 64)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range lp.Keys() {
		if !seen[k] {
			t.Fatalf("lookup key %s not in the score plan", k)
		}
	}
	// A chain repeating one hash plans its key once.
	same := []BlockHash{hashes[0], hashes[0], hashes[0], hashes[0]}
	if p, err = PlanScore(lookupModel(16, grpFull(16)), kb, same, 64); err != nil || len(p.Keys()) != 1 {
		t.Fatalf("PlanScore of a repeated hash = %v keys, %v; want 1 key", len(p.Keys()), err)
	}
}

func TestPlanScoreErrors(t *testing.T) {
	m := lookupModel(16, grpFull(32))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 64, 1)
	cases := []struct {
		name   string
		hashes []BlockHash
		tokens int
		want   error
	}{
		{"negative tokens", hashes, -1, ErrNegativeCount},
		{"short chain", hashes[:3], 64, ErrShortHashChain},
		{"short chain past the lookup's alignment", hashes[:2], 48, ErrShortHashChain},
		{"empty hash past the lookup's alignment", []BlockHash{hashes[0], hashes[1], {}}, 48, ErrEmptyHash},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if p, err := PlanScore(m, kb, tc.hashes, tc.tokens); !errors.Is(err, tc.want) {
				t.Fatalf("PlanScore = %v, %v; want %v", p, err, tc.want)
			}
		})
	}
	p, err := PlanScore(m, kb, hashes, 64)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Score(make([]bool, len(p.Keys())+1)); !errors.Is(err, ErrAnswerCount) {
		t.Fatalf("Score with an answer too many = %v, want ErrAnswerCount", err)
	}
}

// TestScoreProperties checks random models (with and without partial hash
// hits) and random store contents: the hit is the lookup's, no group alone
// serves less than the hybrid hit, the folded count is never below a
// group's prefix, full attention's usable tokens are its prefix, counts
// are whole blocks within the prompt, and a key more never lowers a count.
func TestScoreProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(27, 3))
	for i := 0; i < 300; {
		m := drawModel(rng)
		if m.Validate() != nil {
			continue
		}
		i++
		kb := KeyBuilder{Prefix: "p", Model: m.Name}
		numTokens := rng.IntN(300)
		hashes := promptHashes(m, numTokens, uint32(i))
		p, err := PlanScore(m, kb, hashes, numTokens)
		if err != nil {
			t.Fatalf("case %d: PlanScore: %v", i, err)
		}
		present := map[string]bool{}
		density := rng.Float64()
		for _, k := range p.Keys() {
			present[k] = rng.Float64() < density+0.3
		}
		s, err := p.Score((&storeFake{present: present}).exists(p.Keys()))
		if err != nil {
			t.Fatalf("case %d: Score: %v", i, err)
		}
		checkLookupAgrees(t, m, kb, hashes, numTokens, present, s.HitTokens)
		checkScoreInvariants(t, m, numTokens, s)
		if len(p.Keys()) > 0 {
			present[p.Keys()[rng.IntN(len(p.Keys()))]] = true
			more, _ := p.Score((&storeFake{present: present}).exists(p.Keys()))
			if more.HitTokens < s.HitTokens || more.AnyGroupPrefixTokens < s.AnyGroupPrefixTokens {
				t.Fatalf("case %d: a present key lowered the score from %+v to %+v", i, s, more)
			}
		}
	}
}

// checkScoreInvariants checks one score against the rules that hold for
// every model and store.
func checkScoreInvariants(t *testing.T, m *Model, numTokens int, s Score) {
	t.Helper()
	for _, g := range s.Groups {
		full := g.Kind == KindFullAttention || g.Kind == KindMLA
		switch {
		case g.UsableTokens < s.HitTokens:
			t.Fatalf("%+v: group %d alone serves %d, less than the hybrid hit %d", m, g.Group, g.UsableTokens, s.HitTokens)
		case s.AnyGroupPrefixTokens < g.PrefixTokens:
			t.Fatalf("%+v: folded count %d below group %d's prefix %d", m, s.AnyGroupPrefixTokens, g.Group, g.PrefixTokens)
		case full && !m.PartialHashHits() && g.UsableTokens != g.PrefixTokens:
			t.Fatalf("%+v: full-attention group %d usable %d, prefix %d", m, g.Group, g.UsableTokens, g.PrefixTokens)
		case g.PrefixTokens%g.BlockSize != 0 || g.PrefixTokens > numTokens || g.UsableTokens > numTokens:
			t.Fatalf("%+v: group %d counts %+v for a prompt of %d tokens", m, g.Group, g, numTokens)
		}
	}
}
