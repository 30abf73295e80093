package kvcore

import (
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"testing"
)

// hexHashes is the hex form of hashes, as tasks carry them.
func hexHashes(hashes []BlockHash) []string {
	out := make([]string, len(hashes))
	for i, h := range hashes {
		out[i] = h.Hex()
	}
	return out
}

func TestSaveAndLoadGroups(t *testing.T) {
	m, err := Preset("full-swa-mamba") // full 16, swa 32 window 128, mamba 16
	if err != nil {
		t.Fatal(err)
	}
	got := m.SaveGroups(64, 256)
	full := Chunks(64, 256, 16)
	want := []GroupChunks{
		{Group: 0, Chunks: full},
		// The window's 4 blocks reach the whole 32-token segment: every block.
		{Group: 1, Chunks: []Chunk{{64, 96}, {96, 128}, {128, 160}, {160, 192}, {192, 224}, {224, 256}}},
		{Group: 2, Chunks: []Chunk{{240, 256}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("SaveGroups(64, 256) = %v, want %v", got, want)
	}
	// A load floors its start to the scheduler block size (32) and reads
	// the 4 window blocks before the hit.
	want[1].Chunks = want[1].Chunks[2:]
	if got := m.LoadGroups(80, 256); !reflect.DeepEqual(got, want) {
		t.Fatalf("LoadGroups(80, 256) = %v, want %v", got, want)
	}
	empty := m.SaveGroups(64, 64)
	if len(empty) != 3 {
		t.Fatalf("SaveGroups(64, 64) has %d groups, want every group", len(empty))
	}
	for _, gc := range empty {
		if gc.Chunks == nil || len(gc.Chunks) != 0 {
			t.Fatalf("SaveGroups(64, 64) group %d = %v, want an empty (non-nil) list", gc.Group, gc.Chunks)
		}
	}
	start, end := m.LoadRange(LoadSpec{VLLMCachedTokens: 80, KVPoolCachedTokens: 256})
	if start != 64 || end != 256 {
		t.Fatalf("LoadRange = [%d, %d), want [64, 256)", start, end)
	}
}

func TestPlanSendErrors(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpSWA(16, 32))
	kb := KeyBuilder{Model: m.Name}
	good := func() *SaveTask {
		return &SaveTask{
			Start: 0, End: 48,
			BlockTable:  BlockTable{{0, 1, 2}, {NullBlock, 4, 5}},
			BlockHashes: hexHashes(promptHashes(m, 48, 1)),
			Groups:      m.SaveGroupsHeld(BlockTable{{0, 1, 2}, {NullBlock, 4, 5}}, 0, 48),
		}
	}
	cases := []struct {
		name  string
		edit  func(*SaveTask)
		group int
	}{
		{"group beyond table", func(s *SaveTask) { s.BlockTable = s.BlockTable[:1] }, 1},
		{"group beyond model", func(s *SaveTask) { s.Groups = append(s.Groups, GroupChunks{Group: 2, Chunks: []Chunk{{0, 16}}}) }, 2},
		{"table shorter than chunks", func(s *SaveTask) { s.BlockTable[0] = s.BlockTable[0][:2] }, 0},
		{"null block", func(s *SaveTask) { s.BlockTable[1][1] = NullBlock }, 1},
		{"hash chain too short", func(s *SaveTask) { s.BlockHashes = s.BlockHashes[:2] }, 0},
		{"bad hash", func(s *SaveTask) { s.BlockHashes[2] = "ab@cd" }, 0},
		{"misaligned chunk", func(s *SaveTask) { s.Groups[0].Chunks = []Chunk{{8, 24}} }, 0},
		{"wrong chunk size", func(s *SaveTask) { s.Groups[0].Chunks = []Chunk{{0, 32}} }, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			task := good()
			tc.edit(task)
			items, err := PlanSend(m, kb, task, tc.group, Rank{})
			if !errors.Is(err, ErrChunkOutOfRange) {
				t.Fatalf("PlanSend = %v, %v; want ErrChunkOutOfRange", items, err)
			}
		})
	}
	task := good()
	for g := range 2 {
		if _, err := PlanSend(m, kb, task, g, Rank{}); err != nil {
			t.Fatalf("PlanSend(valid task, group %d): %v", g, err)
		}
	}
	if items, err := PlanSend(m, kb, task, 5, Rank{}); items != nil || err != nil {
		t.Fatalf("PlanSend(unlisted group) = %v, %v; want nothing", items, err)
	}
}

func TestPlanSendStoreRank(t *testing.T) {
	m := lookupModel(16, grpMLA(16), grpFull(16))
	m.Parallel.TP = 2
	kb := KeyBuilder{Model: m.Name}
	hashes := promptHashes(m, 32, 4)
	task := &SaveTask{Start: 0, End: 32, BlockTable: BlockTable{{3, 4}, {5, 6}}, BlockHashes: hexHashes(hashes), Groups: m.SaveGroups(0, 32)}
	r := Rank{TP: 1}
	// MLA: namespace tp0, rank 1 writes chunk 1 of the two; full
	// attention: its own namespace, every chunk.
	for g, want := range []struct {
		rank   Rank
		chunks []int
	}{{Rank{TP: 0}, []int{1}}, {Rank{TP: 1}, []int{0, 1}}} {
		items, err := PlanSend(m, kb, task, g, r)
		if err != nil {
			t.Fatalf("PlanSend group %d: %v", g, err)
		}
		if len(items) != len(want.chunks) {
			t.Fatalf("group %d: %d items, want %d", g, len(items), len(want.chunks))
		}
		for i, it := range items {
			if key := kb.Key(want.rank, g, hashes[want.chunks[i]]); it.Key != key {
				t.Fatalf("group %d item %d key %q, want %q", g, i, it.Key, key)
			}
		}
	}
}

func TestMissingOnly(t *testing.T) {
	items := []TransferItem{{Key: "a"}, {Key: "b"}, {Key: "c"}, {Key: "d"}}
	cases := []struct {
		name   string
		exists []bool
		want   []string
	}{
		{"none present", []bool{false, false, false, false}, []string{"a", "b", "c", "d"}},
		{"some present", []bool{true, false, true, false}, []string{"b", "d"}},
		{"all present", []bool{true, true, true, true}, nil},
		{"answers missing are put", []bool{true, true}, []string{"c", "d"}},
	}
	for _, tc := range cases {
		var got []string
		for _, it := range MissingOnly(items, tc.exists) {
			got = append(got, it.Key)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: MissingOnly = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestPlanLoad(t *testing.T) {
	m := lookupModel(16, grpFull(16), grpSWA(32, 2))
	kb := KeyBuilder{Prefix: "dep", Model: m.Name}
	hashes := promptHashes(m, 96, 9)
	start, end := m.LoadRange(LoadSpec{VLLMCachedTokens: 40, KVPoolCachedTokens: 96})
	task := &LoadTask{
		Start: start, End: end,
		BlockTable:  BlockTable{{10, 11, 12, 13, 14, 15}, {NullBlock, NullBlock, 22}},
		BlockHashes: hexHashes(hashes),
		Groups:      m.LoadGroups(start, end),
	}
	items, err := PlanLoad(m, kb, task, Rank{})
	if err != nil {
		t.Fatalf("PlanLoad: %v", err)
	}
	want := []TransferItem{
		{Key: kb.Key(Rank{}, 0, hashes[2]), Block: 12, Chunk: Chunk{32, 48}, Group: 0, Hash: hashes[2].Hex()},
		{Key: kb.Key(Rank{}, 0, hashes[3]), Block: 13, Chunk: Chunk{48, 64}, Group: 0, Hash: hashes[3].Hex()},
		{Key: kb.Key(Rank{}, 0, hashes[4]), Block: 14, Chunk: Chunk{64, 80}, Group: 0, Hash: hashes[4].Hex()},
		{Key: kb.Key(Rank{}, 0, hashes[5]), Block: 15, Chunk: Chunk{80, 96}, Group: 0, Hash: hashes[5].Hex()},
		{Key: kb.Key(Rank{}, 1, hashes[5]), Block: 22, Chunk: Chunk{64, 96}, Group: 1, Hash: hashes[5].Hex()},
	}
	if !reflect.DeepEqual(items, want) {
		t.Fatalf("PlanLoad = %+v\nwant %+v", items, want)
	}
	task.BlockTable[1] = task.BlockTable[1][:2]
	if _, err := PlanLoad(m, kb, task, Rank{}); !errors.Is(err, ErrChunkOutOfRange) {
		t.Fatalf("PlanLoad with a short table = %v, want ErrChunkOutOfRange", err)
	}
}

func TestLoadErrors(t *testing.T) {
	items := []TransferItem{{Block: 1}, {Block: 2}, {Block: 3}, {Block: 2}}
	miss := errors.New("missing")
	cases := []struct {
		name   string
		perKey []error
		batch  error
		want   []BlockID
	}{
		{"all ok", []error{nil, nil, nil, nil}, nil, nil},
		{"some missing", []error{nil, miss, nil, nil}, nil, []BlockID{2}},
		{"each block once", []error{miss, miss, nil, miss}, nil, []BlockID{1, 2}},
		{"batch failed", nil, errors.New("down"), []BlockID{1, 2, 3}},
		{"batch failed with answers", []error{nil, nil, nil, nil}, errors.New("down"), []BlockID{1, 2, 3}},
		{"answers missing", []error{nil, nil}, nil, []BlockID{3, 2}},
	}
	for _, tc := range cases {
		if got := LoadErrors(items, tc.perKey, tc.batch); !slices.Equal(got, tc.want) {
			t.Errorf("%s: LoadErrors = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestListedBlocks(t *testing.T) {
	m, err := Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	null := NullBlock
	tests := []struct {
		name   string
		table  BlockTable
		groups []GroupChunks
		want   []BlockID
	}{
		{"each chunk's block", BlockTable{{1, 2, 3}, {null, null, 4}}, m.LoadGroups(0, 48), []BlockID{1, 2, 3, 4}},
		{"only the loaded chunks", BlockTable{{1, 2, 3}, {null, null, 4}}, m.LoadGroups(32, 48), []BlockID{3, 4}},
		{"a chunk past the table lists the whole group", BlockTable{{1, 2}, {null, null, 4}}, m.LoadGroups(0, 48), []BlockID{1, 2, 4}},
		{"a group past the model lists its blocks", BlockTable{{1}, {2}, {5, null, 6}},
			[]GroupChunks{{Group: 2, Chunks: []Chunk{{Start: 0, End: 16}}}}, []BlockID{5, 6}},
		{"a group past the table lists nothing", BlockTable{{1}}, m.LoadGroups(0, 16), []BlockID{1}},
		{"duplicates once", BlockTable{{7, 7}, {null, 7}}, m.LoadGroups(0, 32), []BlockID{7}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			task := &LoadTask{BlockTable: tc.table, Groups: tc.groups}
			if got := ListedBlocks(m, task); !slices.Equal(got, tc.want) {
				groups, _ := json.Marshal(tc.groups)
				t.Fatalf("ListedBlocks(%v, %s) = %v, want %v", tc.table, groups, got, tc.want)
			}
		})
	}
}
