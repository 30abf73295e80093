package kvcore

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

// The hit-rate parity scenarios S30–S47 (docs/architecture.md, "Hit-rate
// parity with vLLM"): vLLM's store-connector rules for which blocks a save
// stores and which a lookup may hit, with exact inputs and outputs. Each
// cites the vLLM code it follows; "coordinator.py" and "worker.py" are
// vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/.

// storeSaves fills s with the keys (rank 0) of every chunk SaveGroups lists
// for the save ranges, as a sender storing them would.
func storeSaves(s *storeFake, m *Model, hashes []BlockHash, ranges ...[2]int) {
	kb := KeyBuilder{Model: m.Name}
	for _, r := range ranges {
		for _, gc := range m.SaveGroups(r[0], r[1]) {
			for _, c := range gc.Chunks {
				s.present[kb.Key(Rank{}, gc.Group, hashes[c.HashIndex(m.HashBlockSize)])] = true
			}
		}
	}
}

// S30 (SlidingWindowManager.find_longest_cache_hit,
// _contiguous_blocks_for_hit): a window of W tokens needs
// ceil((W−1)/bs) blocks before the hit, the token computed next being in
// the window. Window 129, block 16: 8 blocks, not 9.
func scenarioSWAWindowBlocks(t *testing.T) {
	cases := []struct{ window, bs, want int }{
		{129, 16, 8}, {128, 16, 8}, {127, 16, 8}, {113, 16, 7}, {17, 16, 1}, {16, 16, 1}, {1, 16, 1}, {8, 8, 1}, {9, 8, 1},
	}
	for _, tc := range cases {
		if got := grpSWA(tc.bs, tc.window).WindowBlocks(); got != tc.want {
			t.Errorf("window %d, block %d: %d blocks, want %d", tc.window, tc.bs, got, tc.want)
		}
	}
	m := lookupModel(16, grpFull(16), grpSWA(16, 129))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 161, 30)
	s := &storeFake{present: map[string]bool{}}
	presentChunks(s, kb, 0, hashes, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9) // full: [0,160)
	presentChunks(s, kb, 1, hashes, 2, 3, 4, 5, 6, 7, 8, 9)       // SWA: the 8 blocks [32,160)
	p, _, hit := lookupOnce(t, m, hashes, 161, s)
	if hit != 160 {
		t.Fatalf("161 tokens, SWA [32,160) present: hit %d, want 160", hit)
	}
	// The SWA keys looked up: the 8 blocks before each 16-token candidate
	// reach every block, so 10 SWA keys and 10 full-attention keys.
	if len(p.Keys()) != 20 {
		t.Fatalf("%d keys, want 20", len(p.Keys()))
	}
	delete(s.present, kb.Key(Rank{}, 1, hashes[2]))
	if _, _, hit := lookupOnce(t, m, hashes, 161, s); hit != 0 {
		t.Fatalf("SWA [32,48) missing: hit %d, want 0 (every shorter candidate needs it too)", hit)
	}
}

// S31 (coordinator.py store_mask → SlidingWindowManager.reachable_block_mask,
// retention None): a save stores, in every scheduler-block segment, the last
// WindowBlocks blocks, so a later request sharing a shorter prefix still
// hits. Full 64 + SWA 16 window 33 (2 blocks), segment 64 = 4 blocks.
func scenarioSWASegmentTails(t *testing.T) {
	m := lookupModel(16, grpFull(64), grpSWA(16, 33))
	got := m.SaveChunks(1, 0, 128)
	want := []Chunk{{32, 48}, {48, 64}, {96, 112}, {112, 128}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("SWA SaveChunks(0, 128) = %v, want %v", got, want)
	}
	if got := m.SaveChunks(1, 64, 128); !reflect.DeepEqual(got, want[2:]) {
		t.Fatalf("SWA SaveChunks(64, 128) = %v, want %v", got, want[2:])
	}
	if got := m.LoadChunks(1, 0, 128); !reflect.DeepEqual(got, want[2:]) {
		t.Fatalf("SWA LoadChunks(0, 128) = %v, want %v (the window before 128)", got, want[2:])
	}
	hashes := promptHashes(m, 128, 31)
	s := &storeFake{present: map[string]bool{}}
	storeSaves(s, m, hashes, [2]int{0, 128})
	// A request sharing the first 64 tokens (65 in all) hits 64: the
	// segment tail [32,64) was stored.
	if _, _, hit := lookupOnce(t, m, hashes, 65, s); hit != 64 {
		t.Fatalf("65-token request sharing 64 tokens: hit %d, want 64", hit)
	}
	if _, _, hit := lookupOnce(t, m, hashes, 128, s); hit != 64 {
		t.Fatalf("the saved 128-token prompt again: hit %d, want 64 (full-hit rule)", hit)
	}
}

// S32 (reachable_block_mask: need ≥ blocks per segment returns None, cache
// all): on full-swa-mamba (full 16, SWA 32 window 128 = 4 blocks, Mamba 16,
// segment 32 = 1 SWA block) a save stores every SWA block; Mamba only the
// state at the end.
func scenarioSWAWholeSegment(t *testing.T) {
	m, err := Preset("full-swa-mamba")
	if err != nil {
		t.Fatal(err)
	}
	got := m.SaveGroups(0, 128)
	want := []GroupChunks{
		{Group: 0, Chunks: Chunks(0, 128, 16)},
		{Group: 1, Chunks: []Chunk{{0, 32}, {32, 64}, {64, 96}, {96, 128}}},
		{Group: 2, Chunks: []Chunk{{112, 128}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("SaveGroups(0, 128) = %v, want %v", got, want)
	}
	hashes := promptHashes(m, 129, 32)
	s := &storeFake{present: map[string]bool{}}
	storeSaves(s, m, hashes, [2]int{0, 64}, [2]int{64, 128})
	if _, _, hit := lookupOnce(t, m, hashes, 129, s); hit != 128 {
		t.Fatalf("129 tokens after saves to 64 and 128: hit %d, want 128", hit)
	}
	if _, _, hit := lookupOnce(t, m, hashes, 97, s); hit != 64 {
		t.Fatalf("97 tokens: hit %d, want 64 (no Mamba state at 96)", hit)
	}
}

// S33 (worker.py _boundary_snapshot_puts; MambaManager.find_longest_cache_hit):
// Mamba state is stored at each save's end only, and a hit needs the state
// at the hit. A request saved to 64, preempted, resumed with 96 tokens and
// saved from 0 again (vLLM's resumed tracker starts at 0 saved) has states
// at 64 and 96; a request sharing 80 tokens hits 64, and the 64-token
// prompt itself 0: the full-hit rule drops it to 48, where no state was saved.
func scenarioMambaStates(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpMamba(16))
	if got := m.SaveChunks(1, 0, 64); !reflect.DeepEqual(got, []Chunk{{48, 64}}) {
		t.Fatalf("Mamba SaveChunks(0, 64) = %v, want [{48 64}]", got)
	}
	hashes := promptHashes(m, 97, 33)
	s := &storeFake{present: map[string]bool{}}
	storeSaves(s, m, hashes, [2]int{0, 64}, [2]int{0, 96})
	cases := []struct{ tokens, want int }{{97, 96}, {81, 64}, {96, 64}, {64, 0}}
	for _, tc := range cases {
		if _, _, hit := lookupOnce(t, m, hashes, tc.tokens, s); hit != tc.want {
			t.Errorf("%d tokens: hit %d, want %d", tc.tokens, hit, tc.want)
		}
	}
}

// S34 (worker.py MooncakeStoreWorker.lookup; scheduler.py
// get_num_new_matched_tokens): a hit covering the whole prompt is re-derived
// at align(num_tokens − 1) from the same answers, so an aligned prompt loses
// a whole scheduler block; need = hit − num_computed_tokens.
func scenarioFullHitVLLM(t *testing.T) {
	m, err := Preset("full-swa-mamba")
	if err != nil {
		t.Fatal(err)
	}
	hashes := promptHashes(m, 65, 34)
	s := &storeFake{present: map[string]bool{}}
	storeSaves(s, m, hashes, [2]int{0, 32}, [2]int{32, 64})
	cases := []struct {
		tokens, computed int
		wantHit, need    int
	}{
		{64, 0, 32, 32}, {65, 0, 64, 64}, {65, 32, 64, 32}, {32, 0, 0, 0}, {33, 32, 32, 0},
	}
	for _, tc := range cases {
		s.calls = 0
		_, _, hit := lookupOnce(t, m, hashes, tc.tokens, s)
		need, spec, _ := Decide(hit, tc.computed, true)
		if hit != tc.wantHit || need != tc.need || (need > 0) != (spec != nil) || s.calls != 1 {
			t.Errorf("%d tokens, %d computed: hit %d need %d spec %v (%d calls), want hit %d need %d, one call",
				tc.tokens, tc.computed, hit, need, spec, s.calls, tc.wantHit, tc.need)
		}
	}
}

// S35 (scheduler.py MooncakeStoreScheduler.__init__ requires align mode;
// kv_cache_utils.py resolve_kv_cache_block_sizes; coordinator.py
// partial_hash_hits_enabled): the hybrid layouts refused, with the field.
// A hash block finer than the Mamba block turns partial hash hits on and
// is accepted since S38, beside full attention and MLA.
func scenarioHybridRefusals(t *testing.T) {
	mode := func(s string) Group { g := grpMamba(16); g.MambaCacheMode = s; return g }
	cases := []struct {
		name    string
		m       *Model
		field   string // "" accepted
		partial bool
	}{
		{"align mode", lookupModel(16, grpFull(16), mode("align")), "", false},
		{"mode none", lookupModel(16, grpFull(16), mode("none")), "groups[1].mamba_cache_mode", false},
		{"mode on attention", func() *Model {
			m := lookupModel(16, grpFull(16), grpMamba(16))
			m.Groups[0].MambaCacheMode = MambaAlign
			return m
		}(), "groups[0].mamba_cache_mode", false},
		{"mamba block not the cache block", lookupModel(16, grpFull(16), grpMamba(32)), "groups[1].block_size", true},
		{"hash finer than mamba block (partial hits, S38)", lookupModel(16, grpFull(32), grpMamba(32)), "", true},
		{"old full-swa-mamba (full 32, swa 16, mamba 32, hash 16)", lookupModel(16, grpFull(32), grpSWA(16, 128), grpMamba(32)), "hash_block_size", true},
		{"mamba-only, hash = block", lookupModel(32, grpMamba(32)), "", false},
		{"mamba-only with dcp", withParallel(lookupModel(32, grpMamba(32)), Parallel{TP: 2, DCP: 2}), "hash_block_size", true},
		{"swa block larger than the cache block", lookupModel(16, grpFull(16), grpSWA(32, 128), grpMamba(16)), "", false},
	}
	for _, tc := range cases {
		err := tc.m.Validate()
		var se *SpecError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: Validate() = %v, want nil", tc.name, err)
		case tc.field != "" && (!errors.As(err, &se) || se.Field != tc.field):
			t.Errorf("%s: Validate() = %v, want a spec error on %s", tc.name, err, tc.field)
		}
		if got := tc.m.PartialHashHits(); got != tc.partial {
			t.Errorf("%s: PartialHashHits() = %v, want %v", tc.name, got, tc.partial)
		}
	}
	for _, name := range PresetNames() {
		if _, err := Preset(name); err != nil {
			t.Errorf("preset %s refused: %v", name, err)
		}
	}
}

// S36 (data.py chunk_hashes_for_block_size; coordinator.py
// align_lookup_length without partial hits): a hash block finer than the
// attention block keys each block by its last hash block, and hits land on
// the scheduler block size only. Full 32, hash 8: 40 tokens with every
// block present hit 32.
func scenarioFineHashAttention(t *testing.T) {
	m := lookupModel(8, grpFull(32), grpSWA(32, 64))
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 72, 36)
	p, err := PlanLookup(m, kb, hashes, 72)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{kb.Key(Rank{}, 0, hashes[3]), kb.Key(Rank{}, 0, hashes[7]), kb.Key(Rank{}, 1, hashes[3]), kb.Key(Rank{}, 1, hashes[7])}
	if !slices.Equal(slices.Sorted(slices.Values(p.Keys())), slices.Sorted(slices.Values(want))) {
		t.Fatalf("keys %q, want %q", p.Keys(), want)
	}
	s := &storeFake{present: map[string]bool{}}
	for _, k := range want {
		s.present[k] = true
	}
	for i := range hashes {
		s.present[kb.Key(Rank{}, 0, hashes[i])] = true
	}
	if _, _, hit := lookupOnce(t, m, hashes, 40, s); hit != 32 {
		t.Fatalf("40 tokens: hit %d, want 32", hit)
	}
	if _, _, hit := lookupOnce(t, m, hashes, 72, s); hit != 64 {
		t.Fatalf("72 tokens: hit %d, want 64", hit)
	}
}

// S37 (worker.py KVCacheStoreSendingThread._handle_request skips
// unavailable source blocks): a save over a sliding-window table whose
// blocks below an earlier hit were freed stores only the blocks held.
// Full 16 + SWA 16 window 17 (1 block), hit at 48, save [0, 80).
func scenarioSaveSkipsNull(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpSWA(16, 17))
	table := BlockTable{{0, 1, 2, 3, 4}, {NullBlock, NullBlock, 12, 13, 14}}
	got := m.SaveGroupsHeld(table, 0, 80)
	want := []GroupChunks{
		{Group: 0, Chunks: Chunks(0, 80, 16)},
		{Group: 1, Chunks: []Chunk{{32, 48}, {48, 64}, {64, 80}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("SaveGroupsHeld = %v, want %v", got, want)
	}
	if all := m.SaveGroups(0, 80); len(all[1].Chunks) != 5 {
		t.Fatalf("SaveGroups lists %d SWA chunks, want all 5 (the mask)", len(all[1].Chunks))
	}
	if short := m.SaveGroupsHeld(table[:1], 0, 80); len(short) != 2 || len(short[1].Chunks) != 0 {
		t.Fatalf("SaveGroupsHeld over a 1-group table = %v, want group 1 empty", short)
	}
}

// partialModel is the MLA + linear-attention shape with partial hash hits:
// MLA 64 and Mamba 64 (align mode), hash block 16, so a Mamba block is 4
// hash blocks (coordinator.py partial_hash_hits_enabled).
func partialModel() *Model { return lookupModel(16, grpMLA(64), grpMamba(64)) }

// S38 (coordinator.py partial_hash_hits_enabled, align_lookup_length): a
// Mamba block larger than the hash block turns partial hash hits on; the
// layout is accepted and hits align to the hash block, not the scheduler
// block. kvmesh still refuses them beside a sliding window and with DCP.
func scenarioPartialAccepted(t *testing.T) {
	m := partialModel()
	if err := m.Validate(); err != nil || !m.PartialHashHits() || m.HitAlignment() != 16 || m.SchedulerBlockSize() != 64 {
		t.Fatalf("Validate %v, partial %v, alignment %d, scheduler block %d; want nil, true, 16, 64", err, m.PartialHashHits(), m.HitAlignment(), m.SchedulerBlockSize())
	}
	if got := lookupModel(64, grpMLA(64), grpMamba(64)).HitAlignment(); got != 64 {
		t.Fatalf("hash = Mamba block: alignment %d, want the scheduler block 64", got)
	}
	refused := []struct {
		name  string
		m     *Model
		field string
	}{
		{"beside a sliding window", lookupModel(16, grpFull(64), grpSWA(16, 64), grpMamba(64)), "hash_block_size"},
		{"with dcp", withParallel(lookupModel(16, grpMamba(64)), Parallel{TP: 2, DCP: 2}), "hash_block_size"},
		{"two Mamba blocks", lookupModel(16, grpMamba(64), grpMamba(32)), "groups[1].block_size"},
	}
	for _, tc := range refused {
		var se *SpecError
		if err := tc.m.Validate(); !errors.As(err, &se) || se.Field != tc.field {
			t.Errorf("%s: Validate() = %v, want a spec error on %s", tc.name, err, tc.field)
		}
	}
}

// S39 (worker.py MooncakeStoreWorker.lookup, fine_grained): every group is
// asked for every hash block of align(num_tokens) = 96 of a 100-token
// prompt, raw hashes, not one per block: 6 keys per group.
func scenarioPartialKeys(t *testing.T) {
	m := partialModel()
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 100, 39)
	p, err := PlanLookup(m, kb, hashes, 100)
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for g := range 2 {
		for i := range 6 {
			want = append(want, kb.Key(Rank{}, g, hashes[i]))
		}
	}
	if !slices.Equal(p.Keys(), want) {
		t.Fatalf("keys %q, want %q", p.Keys(), want)
	}
	if q, _ := PlanLookup(m, kb, hashes, 15); len(q.Keys()) != 0 {
		t.Fatalf("15 tokens (under one hash block): %d keys, want none", len(q.Keys()))
	}
}

// S40 (worker.py _sub_block_tail_puts, _boundary_snapshot_puts;
// single_type_kv_cache_manager.py _cache_partial_tail_block): a 100-token
// prompt saves [0, 64) in its steps (MLA block 0, Mamba state at 64) and
// its tail at P = 96, inside block 1: MLA from the sender's saved offset's
// block to P's, the last cut at P; Mamba only [64, 96), the state at 96.
// A prompt whose last hash boundary is on a block (128) has no tail.
func scenarioPartialTailSave(t *testing.T) {
	m := partialModel()
	steps := m.SaveGroups(0, 64)
	if want := []GroupChunks{{Group: 0, Chunks: []Chunk{{0, 64}}}, {Group: 1, Chunks: []Chunk{{0, 64}}}}; !reflect.DeepEqual(steps, want) {
		t.Fatalf("SaveGroups(0, 64) = %v, want %v", steps, want)
	}
	cases := []struct {
		saved, prompt int
		want          []GroupChunks
	}{
		{64, 100, []GroupChunks{{Group: 0, Chunks: []Chunk{{64, 96}}}, {Group: 1, Chunks: []Chunk{{64, 96}}}}},
		{0, 100, []GroupChunks{{Group: 0, Chunks: []Chunk{{0, 64}, {64, 96}}}, {Group: 1, Chunks: []Chunk{{64, 96}}}}},
		{128, 100, []GroupChunks{{Group: 0, Chunks: []Chunk{{64, 96}}}, {Group: 1, Chunks: []Chunk{{64, 96}}}}},
		{64, 130, []GroupChunks{{Group: 0, Chunks: []Chunk{}}, {Group: 1, Chunks: []Chunk{}}}},
		{0, 15, []GroupChunks{{Group: 0, Chunks: []Chunk{}}, {Group: 1, Chunks: []Chunk{}}}},
	}
	for _, tc := range cases {
		if got := m.PromptTailGroups(tc.saved, tc.prompt); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("PromptTailGroups(%d, %d) = %v, want %v", tc.saved, tc.prompt, got, tc.want)
		}
	}
	if got := lookupModel(64, grpMLA(64), grpMamba(64)).PromptTailGroups(0, 100); len(got[0].Chunks)+len(got[1].Chunks) != 0 {
		t.Fatalf("without partial hits: tail %v, want none", got)
	}
	hashes := promptHashes(m, 100, 40)
	kb := KeyBuilder{Model: m.Name}
	task := &SaveTask{BlockTable: BlockTable{{3, 4}, {9, 8}}, BlockHashes: hexes(hashes), Groups: m.PromptTailGroups(64, 100)}
	items, err := PlanSend(m, kb, task, 1, Rank{})
	if err != nil || len(items) != 1 || items[0].Block != 8 || items[0].Key != kb.Key(Rank{}, 1, hashes[5]) {
		t.Fatalf("PlanSend Mamba tail = %+v, %v; want block 8 keyed by hash 5 (the hash at 96)", items, err)
	}
}

func hexes(hashes []BlockHash) []string {
	out := make([]string, len(hashes))
	for i, h := range hashes {
		out[i] = h.Hex()
	}
	return out
}

// storePartial stores a request's steps and prompt tail (rank 0).
func storePartial(s *storeFake, m *Model, hashes []BlockHash, steps [][2]int, saved, prompt int) {
	kb := KeyBuilder{Model: m.Name}
	storeSaves(s, m, hashes, steps...)
	for _, gc := range m.PromptTailGroups(saved, prompt) {
		for _, c := range gc.Chunks {
			s.present[kb.Key(Rank{}, gc.Group, hashes[c.HashIndex(m.HashBlockSize)])] = true
		}
	}
}

// S41 (FullAttentionManager / MambaManager.find_longest_cache_hit,
// fine-grained; coordinator.py _find_hit_blocks; worker.py lookup; the
// receiving thread's process_tokens and load_mask): after a 100-token
// prompt saved [0, 64) and its tail at 96, a request sharing its 100
// tokens hits 96 inside block 1; MLA loads [0, 64) and [64, 96), Mamba
// [64, 96), each keyed by the hash at the chunk's end. The 96-token prompt
// itself re-derives at align(95) = 80, where neither group stored a key:
// MLA's whole block 0 and Mamba's state at 64 give 64. A 64-token prompt
// re-derives at 48, inside block 0, where MLA stored no key: 0.
func scenarioPartialHit(t *testing.T) {
	m := partialModel()
	hashes := promptHashes(m, 120, 41)
	s := &storeFake{present: map[string]bool{}}
	storePartial(s, m, hashes, [][2]int{{0, 64}}, 64, 100)
	cases := []struct{ tokens, want int }{{120, 96}, {100, 96}, {97, 96}, {96, 64}, {70, 64}, {64, 0}, {48, 0}}
	for _, tc := range cases {
		if _, _, hit := lookupOnce(t, m, hashes, tc.tokens, s); hit != tc.want {
			t.Errorf("%d tokens: hit %d, want %d", tc.tokens, hit, tc.want)
		}
	}
	p, answers, hit := lookupOnce(t, m, hashes, 120, s)
	tails, err := p.TailKeys(answers, hit)
	if err != nil || !reflect.DeepEqual(tails, []TailKey{{0, 96}, {1, 96}}) {
		t.Fatalf("TailKeys = %v, %v; want both at 96", tails, err)
	}
	need, spec, _ := Decide(hit, 16, true)
	if need != 80 || spec == nil {
		t.Fatalf("Decide(96, 16) = %d, %v; want 80 with a spec", need, spec)
	}
	start, end := m.LoadRange(*spec)
	want := []GroupChunks{{Group: 0, Chunks: []Chunk{{0, 64}, {64, 96}}}, {Group: 1, Chunks: []Chunk{{64, 96}}}}
	if got := m.LoadGroupsTail(start, end, tails); !reflect.DeepEqual(got, want) {
		t.Fatalf("LoadGroupsTail(%d, %d) = %v, want %v", start, end, got, want)
	}
}

// S42 (worker.py _tail_key_boundaries, KVCacheStoreRecvingThread
// ._handle_request): the store holds MLA's block 0 and its tail at 96, and
// Mamba's state at 80 only (its state at 96 evicted; an 88-token prompt
// left 80). A 112-token request: MLA hits 96 alone, Mamba 80, so the hit is
// 80; MLA has no key at 80, and its tail key is the next boundary of the
// block it stored, 96: its last chunk is read from the 96 key.
func scenarioPartialTailKey(t *testing.T) {
	m := partialModel()
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 112, 42)
	s := &storeFake{present: map[string]bool{
		kb.Key(Rank{}, 0, hashes[3]): true,
		kb.Key(Rank{}, 0, hashes[5]): true,
		kb.Key(Rank{}, 1, hashes[3]): true,
		kb.Key(Rank{}, 1, hashes[4]): true,
	}}
	p, answers, hit := lookupOnce(t, m, hashes, 112, s)
	if hit != 80 {
		t.Fatalf("hit %d, want 80", hit)
	}
	tails, err := p.TailKeys(answers, hit)
	if err != nil || !reflect.DeepEqual(tails, []TailKey{{0, 96}, {1, 80}}) {
		t.Fatalf("TailKeys = %v, %v; want MLA at 96, Mamba at 80", tails, err)
	}
	got := m.LoadGroupsTail(0, hit, tails)
	want := []GroupChunks{{Group: 0, Chunks: []Chunk{{0, 64}, {64, 96}}}, {Group: 1, Chunks: []Chunk{{64, 80}}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("LoadGroupsTail = %v, want %v", got, want)
	}
	if plain := m.LoadGroups(0, hit); !reflect.DeepEqual(plain[0].Chunks, []Chunk{{0, 64}, {64, 80}}) {
		t.Fatalf("LoadGroups (no tail keys) MLA = %v, want the chunk cut at the hit", plain[0].Chunks)
	}
	if _, err := p.TailKeys(answers[:1], hit); !errors.Is(err, ErrAnswerCount) {
		t.Fatalf("TailKeys with one answer: %v, want ErrAnswerCount", err)
	}
}

// S43 (data.py ChunkedTokenDatabase.prepare_values: a sub-block chunk moves
// the whole block, cdiv(span, block_size) blocks; process_tokens keys it by
// the hash at its end): a load's sub-block chunk is one TransferItem of the
// chunk's block under the hash at its end; a chunk not ending on a hash
// boundary, or a sub-block chunk of a layout without partial hits, is
// refused.
func scenarioPartialChunkItems(t *testing.T) {
	m := partialModel()
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 112, 43)
	task := &LoadTask{BlockTable: BlockTable{{5, 6}, {7, 8}}, BlockHashes: hexes(hashes),
		Groups: []GroupChunks{{Group: 0, Chunks: []Chunk{{0, 64}, {64, 96}}}, {Group: 1, Chunks: []Chunk{{64, 80}}}}}
	items, err := PlanLoad(m, kb, task, Rank{})
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		block BlockID
		hash  int
	}{{5, 3}, {6, 5}, {8, 4}}
	if len(items) != len(want) {
		t.Fatalf("%d items, want %d", len(items), len(want))
	}
	for i, w := range want {
		if items[i].Block != w.block || items[i].Key != kb.Key(Rank{}, items[i].Group, hashes[w.hash]) || items[i].Hash != hashes[w.hash].Hex() {
			t.Errorf("item %d = %+v, want block %d keyed by hash %d", i, items[i], w.block, w.hash)
		}
	}
	bad := []struct {
		name string
		m    *Model
		c    Chunk
	}{
		{"not on a hash boundary", m, Chunk{64, 90}},
		{"past the block", m, Chunk{64, 144}},
		{"sub-block without partial hits", lookupModel(64, grpMLA(64), grpMamba(64)), Chunk{64, 96}},
	}
	for _, tc := range bad {
		task := &LoadTask{BlockTable: BlockTable{{5, 6, 7}, {7, 8, 9}}, BlockHashes: hexes(promptHashes(tc.m, 192, 43)), Groups: []GroupChunks{{Group: 0, Chunks: []Chunk{tc.c}}}}
		if _, err := PlanLoad(tc.m, kb, task, Rank{}); !errors.Is(err, ErrChunkOutOfRange) {
			t.Errorf("%s: PlanLoad(%v) = %v, want ErrChunkOutOfRange", tc.name, tc.c, err)
		}
	}
}

func TestScenariosVLLM(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S30_swa_window_blocks_ceil_window_minus_one", scenarioSWAWindowBlocks},
		{"S31_swa_save_keeps_segment_tails", scenarioSWASegmentTails},
		{"S32_swa_tail_reaches_whole_segment", scenarioSWAWholeSegment},
		{"S33_mamba_state_per_save_and_resume", scenarioMambaStates},
		{"S34_full_hit_recomputes_one_token", scenarioFullHitVLLM},
		{"S35_hybrid_spec_refusals", scenarioHybridRefusals},
		{"S36_hash_block_finer_than_attention_block", scenarioFineHashAttention},
		{"S37_save_skips_freed_window_blocks", scenarioSaveSkipsNull},
		{"S38_partial_hits_layouts_accepted", scenarioPartialAccepted},
		{"S39_partial_lookup_every_hash_block", scenarioPartialKeys},
		{"S40_partial_prompt_tail_save", scenarioPartialTailSave},
		{"S41_partial_hit_inside_a_block", scenarioPartialHit},
		{"S42_partial_tail_key_later_boundary", scenarioPartialTailKey},
		{"S43_partial_chunk_whole_block_bytes", scenarioPartialChunkItems},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}
