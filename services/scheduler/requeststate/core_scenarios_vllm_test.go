package requeststate

import (
	"errors"
	"reflect"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// S44 (coordinator.py store_mask → reachable_block_mask; worker.py
// KVCacheStoreSendingThread._handle_request skips unavailable source
// blocks): full 16 + SWA 16 window 17 (one block). A 96-token request hits
// 48 in the store; its SWA blocks below the window of the hit (0 and 1)
// are null. Once loaded and computed to 80, its save of [0, 80) lists
// every full-attention chunk and only the SWA chunks whose block is held;
// the sender's validation accepts it (nothing dead-lettered), while a task
// listing the null blocks' chunks is refused null_block.
func scenarioSWAHitSaveHeld(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpSWA(16, 17))
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(trkHashes(6), 96)
	table := tbl(ids(1, 6), []kvcore.BlockID{kvcore.NullBlock, kvcore.NullBlock, 12, 13, 14, 15})
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 48}))
	noErr(t, tr.OnAllocate(m, 48, table))
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table}))
	if len(eff.Loads) != 1 || len(eff.Saves) != 0 {
		t.Fatalf("new step: %d loads, %d saves; want the load only", len(eff.Loads), len(eff.Saves))
	}
	if got := eff.Loads[0].Groups[1].Chunks; !slices.Equal(got, []kvcore.Chunk{{Start: 32, End: 48}}) {
		t.Fatalf("load SWA chunks %v, want the window [32,48)", got)
	}
	noErr(t, tr.OnLoadResult(eff.Loads[0].TaskID, nil))
	eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 80}))
	if len(eff.Saves) != 1 || eff.Failed || tr.State != StateRunning {
		t.Fatalf("running step: saves %+v, failed %v, state %s; want one save", eff.Saves, eff.Failed, tr.State)
	}
	task := eff.Saves[0]
	want := []kvcore.GroupChunks{{Group: 0, Chunks: kvcore.Chunks(0, 80, 16)}, {Group: 1, Chunks: []kvcore.Chunk{{Start: 32, End: 48}, {Start: 48, End: 64}, {Start: 64, End: 80}}}}
	if task.Start != 0 || task.End != 80 || !reflect.DeepEqual(task.Groups, want) {
		t.Fatalf("save [%d,%d) %v, want [0,80) %v", task.Start, task.End, task.Groups, want)
	}
	for _, v := range kvcore.ValidateSave(m, []int{32, 32}, &task) {
		if !v.OK() {
			t.Fatalf("tracker-built save refused: %+v", v)
		}
	}
	forged := task
	forged.Groups = m.SaveGroups(0, 80)
	if v := kvcore.ValidateSave(m, []int{32, 32}, &forged); !v[0].OK() || v[1].Reason != kvcore.ReasonNullBlock {
		t.Fatalf("save listing the freed blocks: verdicts %+v, want group 1 null_block", v)
	}
	dropped := task
	dropped.Groups = []kvcore.GroupChunks{want[0], {Group: 1, Chunks: []kvcore.Chunk{{Start: 32, End: 48}, {Start: 64, End: 80}}}}
	if v := kvcore.ValidateSave(m, []int{32, 32}, &dropped); v[1].Reason != kvcore.ReasonChunksMismatch {
		t.Fatalf("save leaving out a held chunk: verdicts %+v, want group 1 chunks_mismatch", v)
	}
}

// S45 (worker.py KVCacheStoreRecvingThread._handle_request,
// _tail_key_boundaries; data.py process_tokens): under partial hash hits
// (MLA 64 + Mamba 64, hash 16) the tracker builds the load of a hit inside
// a block. The lookup hit 80 with MLA's tail key at 96 (S42): the load task
// covers [0, 80), MLA reads block 0 and block 1 keyed at 96, Mamba block 1
// keyed at 80, and the task's hash chain reaches the tail key. Without tail
// keys MLA's chunk ends at the hit. A hit inside a block of a layout
// without partial hits is refused (every block in error).
func scenarioPartialLoadTask(t *testing.T) {
	m := partialModel()
	hashes := promptHashes(m, 112, 45)
	cases := []struct {
		name  string
		tails []kvcore.TailKey
		want  []kvcore.GroupChunks
	}{
		{"tail keys", []kvcore.TailKey{{Group: 0, Tokens: 96}, {Group: 1, Tokens: 80}}, []kvcore.GroupChunks{{Group: 0, Chunks: []kvcore.Chunk{{Start: 0, End: 64}, {Start: 64, End: 96}}}, {Group: 1, Chunks: []kvcore.Chunk{{Start: 64, End: 80}}}}},
		{"no tail keys", nil, []kvcore.GroupChunks{{Group: 0, Chunks: []kvcore.Chunk{{Start: 0, End: 64}, {Start: 64, End: 80}}}, {Group: 1, Chunks: []kvcore.Chunk{{Start: 64, End: 80}}}}},
	}
	for _, tc := range cases {
		tr := NewTracker(m, "e1", "r1")
		tr.OnAdmit(hexes(hashes), 112)
		table := tbl([]kvcore.BlockID{5, 6}, []kvcore.BlockID{kvcore.NullBlock, 8})
		noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 80, TailKeys: tc.tails}))
		noErr(t, tr.OnAllocate(m, 80, table))
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad}))
		if len(eff.Loads) != 1 {
			t.Fatalf("%s: loads %+v, want one", tc.name, eff.Loads)
		}
		task := eff.Loads[0]
		if task.Start != 0 || task.End != 80 || !reflect.DeepEqual(task.Groups, tc.want) {
			t.Fatalf("%s: load [%d,%d) %v, want [0,80) %v", tc.name, task.Start, task.End, task.Groups, tc.want)
		}
		items, err := kvcore.PlanLoad(m, kvcore.KeysOf(m), &task, kvcore.Rank{})
		if err != nil || len(items) != 3 {
			t.Fatalf("%s: PlanLoad = %+v, %v; want 3 items", tc.name, items, err)
		}
		if last := tc.want[0].Chunks[1]; items[1].Block != 6 || items[1].Hash != hashes[last.End/16-1].Hex() {
			t.Fatalf("%s: MLA block 1 item %+v, want block 6 keyed at %d", tc.name, items[1], last.End)
		}
	}
	plain := lookupModel(64, grpMLA(64), grpMamba(64))
	tr := NewTracker(plain, "e1", "r1")
	tr.OnAdmit(hexes(promptHashes(plain, 128, 45)), 128)
	noErr(t, tr.OnLookup(plain, &kvcore.LoadSpec{KVPoolCachedTokens: 80}))
	noErr(t, tr.OnAllocate(plain, 80, tbl([]kvcore.BlockID{5, 6}, []kvcore.BlockID{7, 8})))
	eff := tr.Step(plain, kvcore.Step{Kind: kvcore.StepPendingLoad})
	if !errors.Is(eff.Err, kvcore.ErrChunkOutOfRange) || len(eff.Loads) != 0 || len(eff.Feedback) != 1 || len(eff.Feedback[0].LoadErrors) != 4 {
		t.Fatalf("hit 80 without partial hits: %+v, want the load abandoned with every block in error", eff)
	}
}

// S46 (worker.py _maybe_offload_boundary_states → _sub_block_tail_puts;
// single_type_kv_cache_manager.py _cache_partial_tail_block): a 100-token
// prompt under partial hash hits stores, at the step that reaches it, its
// tail at P = 96 inside block 1 — after that step's save of [0, 64), a
// task [64, 96) listing MLA's and Mamba's block 1 cut at 96, keyed by the
// hash at 96 — once per allocation epoch; the sender's validation accepts
// it. A prompt computed in one step gets both saves in that step. A
// resumed request whose re-prefill completes P's block stores no tail.
func scenarioPartialTailTask(t *testing.T) {
	m := partialModel()
	hashes := hexes(promptHashes(m, 100, 46))
	table := tbl([]kvcore.BlockID{1, 2}, []kvcore.BlockID{3, 4})
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(hashes, 100)
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: table}))
	if len(eff.Saves) != 1 || eff.Saves[0].End != 64 {
		t.Fatalf("64 tokens: saves %+v, want [0,64)", eff.Saves)
	}
	eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 100}))
	if len(eff.Saves) != 1 {
		t.Fatalf("100 tokens: saves %+v, want the prompt tail", eff.Saves)
	}
	tail := eff.Saves[0]
	want := []kvcore.GroupChunks{{Group: 0, Chunks: []kvcore.Chunk{{Start: 64, End: 96}}}, {Group: 1, Chunks: []kvcore.Chunk{{Start: 64, End: 96}}}}
	if tail.Start != 64 || tail.End != 96 || len(tail.BlockHashes) != 6 || !reflect.DeepEqual(tail.Groups, want) {
		t.Fatalf("tail save [%d,%d) %v (%d hashes), want [64,96) %v (6 hashes)", tail.Start, tail.End, tail.Groups, len(tail.BlockHashes), want)
	}
	for _, v := range kvcore.ValidateSave(m, []int{8, 8}, &tail) {
		if !v.OK() {
			t.Fatalf("tail save refused: %+v", v)
		}
	}
	kb := kvcore.KeysOf(m)
	for g, block := range []kvcore.BlockID{2, 4} {
		items, err := kvcore.PlanSend(m, kb, &tail, g, kvcore.Rank{})
		if err != nil || len(items) != 1 || items[0].Block != block || items[0].Hash != hashes[5] {
			t.Fatalf("group %d: PlanSend = %+v, %v; want block %d keyed by hash 5", g, items, err, block)
		}
	}
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 100})); len(eff.Saves) != 0 {
		t.Fatalf("a second step at 100: saves %+v, want none (once per epoch)", eff.Saves)
	}

	one := NewTracker(m, "e1", "r2")
	one.OnAdmit(hashes, 100)
	eff = noErr(t, one.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 100, Table: table}))
	if len(eff.Saves) != 2 || eff.Saves[0].End != 64 || eff.Saves[1].Start != 64 || eff.Saves[1].End != 96 {
		t.Fatalf("one step of 100: saves %+v, want [0,64) then the tail [64,96)", eff.Saves)
	}
	one.Step(m, kvcore.Step{Kind: kvcore.StepPreempted})
	long := hexes(promptHashes(m, 128, 46))
	eff = noErr(t, one.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 130, PrefillTokens: 130, Hashes: long, Table: tbl(ids(1, 3), ids(4, 3))}))
	if len(eff.Saves) != 1 || eff.Saves[0].End != 128 {
		t.Fatalf("resumed past P's block: saves %+v, want only [0,128)", eff.Saves)
	}
}

// S47 (fail closed): the sender refuses a prompt-tail task the tracker
// would not build: a chunk outside PromptTailChunks, an end off the hash
// grid, a listed chunk on a null block. A Mamba block the table does not
// hold is left out of the tracker's own task, which stays valid.
func scenarioPartialTailForged(t *testing.T) {
	m := partialModel()
	hashes := hexes(promptHashes(m, 100, 47))
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(hashes, 100)
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 100, Table: tbl([]kvcore.BlockID{1, 2}, []kvcore.BlockID{3, kvcore.NullBlock})}))
	if len(eff.Saves) != 2 {
		t.Fatalf("saves %+v, want the step's and the tail", eff.Saves)
	}
	tail := eff.Saves[1]
	if !reflect.DeepEqual(tail.Groups, []kvcore.GroupChunks{{Group: 0, Chunks: []kvcore.Chunk{{Start: 64, End: 96}}}, {Group: 1, Chunks: []kvcore.Chunk{}}}) {
		t.Fatalf("tail groups %v, want Mamba's null block left out", tail.Groups)
	}
	if v := kvcore.ValidateSave(m, nil, &tail); !v[0].OK() || !v[1].OK() {
		t.Fatalf("tracker-built tail refused: %+v", v)
	}
	cases := []struct {
		name   string
		mutate func(s *kvcore.SaveTask)
		group  int
		want   kvcore.Reason
	}{
		{"whole block not in the tail", func(s *kvcore.SaveTask) {
			s.Groups[0].Chunks = []kvcore.Chunk{{Start: 0, End: 64}, {Start: 64, End: 96}}
		}, 0, kvcore.ReasonChunksMismatch},
		{"cut at another boundary", func(s *kvcore.SaveTask) { s.Groups[0].Chunks = []kvcore.Chunk{{Start: 64, End: 80}} }, 0, kvcore.ReasonChunksMismatch},
		{"end off the hash grid", func(s *kvcore.SaveTask) { s.End = 90 }, 0, kvcore.ReasonTokenRangeInvalid},
		{"null block listed", func(s *kvcore.SaveTask) { s.Groups[1].Chunks = []kvcore.Chunk{{Start: 64, End: 96}} }, 1, kvcore.ReasonNullBlock},
	}
	for _, tc := range cases {
		forged := tail
		forged.Groups = []kvcore.GroupChunks{{Group: 0, Chunks: slices.Clone(tail.Groups[0].Chunks)}, {Group: 1, Chunks: slices.Clone(tail.Groups[1].Chunks)}}
		tc.mutate(&forged)
		if v := kvcore.ValidateSave(m, nil, &forged); v[tc.group].Reason != tc.want {
			t.Errorf("%s: verdicts %+v, want group %d %q", tc.name, v, tc.group, tc.want)
		}
	}
	plain := lookupModel(64, grpMLA(64), grpMamba(64))
	forged := tail
	forged.Model = plain.Name
	if v := kvcore.ValidateSave(plain, nil, &forged); v[0].Reason != kvcore.ReasonTokenRangeInvalid {
		t.Fatalf("a tail task without partial hits: verdicts %+v, want token_range_invalid", v)
	}
}

func TestScenariosVLLMTracker(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S44_swa_hit_then_save_skips_freed_blocks", scenarioSWAHitSaveHeld},
		{"S45_partial_load_task_inside_a_block", scenarioPartialLoadTask},
		{"S46_partial_prompt_tail_save_task", scenarioPartialTailTask},
		{"S47_partial_prompt_tail_forged_refused", scenarioPartialTailForged},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}
