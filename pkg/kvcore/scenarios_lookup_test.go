package kvcore

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

// The scenarios of docs/architecture.md that lookup, keys
// and chunk planning own. bs 16 / hash block 16 unless a case says otherwise.

// scenarioNS is the key namespace P of the scenarios (rank 0, group 0).
const scenarioNS = "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"

var errNoKey = errors.New("key not in store")

// presentChunks fills a fake store with group g's keys (rank 0) of the
// chunks at hash indices idx.
func presentChunks(s *storeFake, kb KeyBuilder, g int, hashes []BlockHash, idx ...int) {
	for _, i := range idx {
		s.present[kb.Key(Rank{}, g, hashes[i])] = true
	}
}

// lookupOnce plans a lookup, asks the store once and resolves the hit.
func lookupOnce(t *testing.T, m *Model, hashes []BlockHash, numTokens int, s *storeFake) (*LookupPlan, []bool, int) {
	t.Helper()
	p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, hashes, numTokens)
	if err != nil {
		t.Fatalf("PlanLookup(%d tokens): %v", numTokens, err)
	}
	answers := s.exists(p.Keys())
	hit, err := p.Resolve(answers)
	if err != nil {
		t.Fatalf("Resolve: %v", err)
	}
	return p, answers, hit
}

func TestScenarios(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S01_key_prefix", scenarioKeyPrefix},
		{"S02_chunking_bs32_hash8", scenarioChunking},
		{"S03_full_hit_rule_one_round_trip", scenarioFullHit},
		{"S04_full_plus_mamba_all_groups", scenarioFullMamba},
		{"S05_sliding_window_reachable_keys", scenarioSlidingWindow},
		{"S06_need_and_load_spec", scenarioNeed},
		{"S14_send_from_saved_offset", scenarioSendOffset},
		{"S15_send_missing_only_per_group", scenarioSendMissing},
		{"S19_load_errors", scenarioLoadErrors},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}

func scenarioKeyPrefix(t *testing.T) {
	h := BlockHash{0xde, 0xad, 0xbe, 0xef}
	plain := KeyBuilder{Model: "test-model"}.Key(Rank{}, 0, h)
	a := KeyBuilder{Prefix: "depA", Model: "test-model"}.Key(Rank{}, 0, h)
	b := KeyBuilder{Prefix: "depB", Model: "test-model"}.Key(Rank{}, 0, h)
	if plain != scenarioNS+"@deadbeef" {
		t.Errorf("no prefix: %q, want %q", plain, scenarioNS+"@deadbeef")
	}
	if a != "depA@"+scenarioNS+"@deadbeef" {
		t.Errorf("prefix depA: %q, want %q", a, "depA@"+scenarioNS+"@deadbeef")
	}
	if a == b {
		t.Errorf("depA and depB share key %q", a)
	}
}

func scenarioChunking(t *testing.T) {
	m := lookupModel(8, grpFull(32))
	hashes := promptHashes(m, 96, 2)
	groups := m.SaveGroups(64, 96)
	if want := []GroupChunks{{Group: 0, Chunks: []Chunk{{Start: 64, End: 96}}}}; !reflect.DeepEqual(groups, want) {
		t.Fatalf("SaveGroups(64, 96) = %v, want %v", groups, want)
	}
	if hi := groups[0].Chunks[0].HashIndex(m.HashBlockSize); hi != 11 {
		t.Fatalf("hash index %d, want 11", hi)
	}
	task := &SaveTask{Start: 64, End: 96, BlockTable: BlockTable{{5, 6, 7}}, BlockHashes: hexHashes(hashes), Groups: groups}
	items, err := PlanSend(m, KeyBuilder{Model: m.Name}, task, 0, Rank{})
	if err != nil {
		t.Fatalf("PlanSend: %v", err)
	}
	want := []TransferItem{{Key: scenarioNS + "@" + hashes[11].Hex(), Block: 7, Chunk: Chunk{64, 96}, Hash: hashes[11].Hex()}}
	if !reflect.DeepEqual(items, want) {
		t.Fatalf("PlanSend = %+v, want %+v", items, want)
	}
}

func scenarioFullHit(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 48, 3)
	cases := []struct {
		name      string
		tokens    int
		present   []int // hash indices in the store
		wantHit   int
		wantFirst int // Hit before the full-hit rule
	}{
		{"48_tokens_110", 48, []int{0, 1}, 32, 32},
		{"32_tokens_11", 32, []int{0, 1}, 16, 32},
		{"33_tokens_11", 33, []int{0, 1}, 32, 32},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := &storeFake{present: map[string]bool{}}
			presentChunks(s, kb, 0, hashes, tc.present...)
			p, answers, hit := lookupOnce(t, m, hashes, tc.tokens, s)
			if hit != tc.wantHit {
				t.Fatalf("hit %d, want %d", hit, tc.wantHit)
			}
			if first := p.Hit(answers, tc.tokens); first != tc.wantFirst {
				t.Fatalf("Hit(limit %d) = %d, want %d", tc.tokens, first, tc.wantFirst)
			}
			if s.calls != 1 {
				t.Fatalf("%d existence round-trips, want 1", s.calls)
			}
		})
	}
}

func scenarioFullMamba(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpMamba(16))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 33, 4)
	cases := []struct {
		name          string
		full, mambaAt []int
		want          int
	}{
		{"all_present", []int{0, 1}, []int{0, 1}, 32},
		{"full_chunk_missing", []int{1}, []int{0, 1}, 0},
		{"mamba_states_missing", []int{0, 1}, nil, 0},
		{"mamba_state_at_32_missing", []int{0, 1}, []int{0}, 16},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := &storeFake{present: map[string]bool{}}
			presentChunks(s, kb, 0, hashes, tc.full...)
			presentChunks(s, kb, 1, hashes, tc.mambaAt...)
			if _, _, hit := lookupOnce(t, m, hashes, 33, s); hit != tc.want {
				t.Fatalf("hit %d, want %d", hit, tc.want)
			}
		})
	}
}

func scenarioSlidingWindow(t *testing.T) {
	m := lookupModel(8, grpFull(32), grpSWA(8, 8))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 64, 5)
	p, err := PlanLookup(m, kb, hashes, 64)
	if err != nil {
		t.Fatalf("PlanLookup: %v", err)
	}
	ns1 := "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1"
	want := []string{
		scenarioNS + "@" + hashes[3].Hex(), scenarioNS + "@" + hashes[7].Hex(), // full: [0,32) and [32,64)
		ns1 + "@" + hashes[3].Hex(), ns1 + "@" + hashes[7].Hex(), // SWA: [24,32) and [56,64)
	}
	if got := slices.Sorted(slices.Values(p.Keys())); !slices.Equal(got, slices.Sorted(slices.Values(want))) {
		t.Fatalf("keys %q, want %q", p.Keys(), want)
	}
	s := &storeFake{present: map[string]bool{}}
	for _, k := range want {
		s.present[k] = true
	}
	if _, _, hit := lookupOnce(t, m, hashes, 64, s); hit != 32 {
		t.Fatalf("64 tokens, all present: hit %d, want 32 (full-hit rule)", hit)
	}
	if _, _, hit := lookupOnce(t, m, hashes, 65, s); hit != 64 {
		t.Fatalf("65 tokens, all present: hit %d, want 64", hit)
	}
	delete(s.present, ns1+"@"+hashes[3].Hex())
	if _, _, hit := lookupOnce(t, m, hashes, 65, s); hit != 64 {
		t.Fatalf("65 tokens, SWA [24,32) missing: hit %d, want 64 (out of the window at 64)", hit)
	}
}

func scenarioNeed(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 48, 6)
	s := &storeFake{present: map[string]bool{}}
	presentChunks(s, kb, 0, hashes, 0, 1)
	_, _, hit := lookupOnce(t, m, hashes, 48, s)
	short, _, shortHit := lookupOnce(t, m, hashes, 12, s)
	if len(short.Keys()) != 0 {
		t.Fatalf("12 tokens: %d keys, want none", len(short.Keys()))
	}
	cases := []struct {
		name      string
		hit       int
		computed  int
		wantNeed  int
		wantSpec  *LoadSpec
		wantAsync bool
	}{
		{"hit32_computed16", hit, 16, 16, &LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}, true},
		{"hit32_computed32", hit, 32, 0, nil, false},
		{"12_tokens", shortHit, 0, 0, nil, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			need, spec, async := Decide(tc.hit, tc.computed, true)
			if need != tc.wantNeed || async != tc.wantAsync || !reflect.DeepEqual(spec, tc.wantSpec) {
				t.Fatalf("Decide(%d, %d) = (%d, %+v, %v), want (%d, %+v, %v)",
					tc.hit, tc.computed, need, spec, async, tc.wantNeed, tc.wantSpec, tc.wantAsync)
			}
		})
	}
}

func scenarioSendOffset(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	hashes := promptHashes(m, 64, 7)
	task := &SaveTask{Start: 32, End: 64, BlockTable: BlockTable{{0, 1, 2, 3}}, BlockHashes: hexHashes(hashes), Groups: m.SaveGroups(32, 64)}
	items, err := PlanSend(m, KeyBuilder{Model: m.Name}, task, 0, Rank{})
	if err != nil {
		t.Fatalf("PlanSend: %v", err)
	}
	want := []TransferItem{
		{Key: scenarioNS + "@" + hashes[2].Hex(), Block: 2, Chunk: Chunk{32, 48}, Hash: hashes[2].Hex()},
		{Key: scenarioNS + "@" + hashes[3].Hex(), Block: 3, Chunk: Chunk{48, 64}, Hash: hashes[3].Hex()},
	}
	if !reflect.DeepEqual(items, want) {
		t.Fatalf("PlanSend = %+v, want %+v", items, want)
	}
}

func scenarioSendMissing(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpSWA(16, 32))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 64, 8)
	task := &SaveTask{
		Start: 0, End: 64,
		BlockTable:  BlockTable{{0, 1, 2, 3}, {NullBlock, NullBlock, 6, 7}},
		BlockHashes: hexHashes(hashes),
		Groups:      m.SaveGroupsHeld(BlockTable{{0, 1, 2, 3}, {NullBlock, NullBlock, 6, 7}}, 0, 64),
	}
	s := &storeFake{present: map[string]bool{}}
	presentChunks(s, kb, 0, hashes, 0, 1)
	presentChunks(s, kb, 1, hashes, 2)
	want := [][]TransferItem{
		{
			{Key: kb.Key(Rank{}, 0, hashes[2]), Block: 2, Chunk: Chunk{32, 48}, Group: 0, Hash: hashes[2].Hex()},
			{Key: kb.Key(Rank{}, 0, hashes[3]), Block: 3, Chunk: Chunk{48, 64}, Group: 0, Hash: hashes[3].Hex()},
		},
		{{Key: kb.Key(Rank{}, 1, hashes[3]), Block: 7, Chunk: Chunk{48, 64}, Group: 1, Hash: hashes[3].Hex()}},
	}
	for g := range m.Groups {
		items, err := PlanSend(m, kb, task, g, Rank{})
		if err != nil {
			t.Fatalf("PlanSend group %d: %v", g, err)
		}
		if put := MissingOnly(items, s.exists(keysOf(items))); !reflect.DeepEqual(put, want[g]) {
			t.Fatalf("group %d puts %+v, want %+v", g, put, want[g])
		}
	}
}

func scenarioLoadErrors(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 48, 9)
	start, end := m.LoadRange(LoadSpec{VLLMCachedTokens: 0, KVPoolCachedTokens: 48, CanLoad: true})
	task := &LoadTask{Start: start, End: end, BlockTable: BlockTable{{0, 1, 2}}, BlockHashes: hexHashes(hashes), Groups: m.LoadGroups(start, end)}
	items, err := PlanLoad(m, kb, task, Rank{})
	if err != nil {
		t.Fatalf("PlanLoad: %v", err)
	}
	s := &storeFake{present: map[string]bool{}}
	presentChunks(s, kb, 0, hashes, 0)
	var perKey []error
	for _, ok := range s.exists(keysOf(items)) {
		perKey = append(perKey, map[bool]error{true: nil, false: errNoKey}[ok])
	}
	if got := LoadErrors(items, perKey, nil); !slices.Equal(got, []BlockID{1, 2}) {
		t.Fatalf("store answers [ok, missing, missing]: load errors %v, want [1 2]", got)
	}
	if got := LoadErrors(items, nil, errors.New("store down")); !slices.Equal(got, []BlockID{0, 1, 2}) {
		t.Fatalf("batch failure: load errors %v, want [0 1 2]", got)
	}
}

func keysOf(items []TransferItem) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.Key
	}
	return out
}
