package kvcore

import (
	"encoding/json"
	"reflect"
	"slices"
	"testing"
)

// The null-block scenarios of issue 14: an engine declares the id its
// block tables use for the null block, and the edge that receives the
// tables turns it into NullBlock once. vLLM's null block is block 0:
// BlockPool.__init__ (vllm/v1/core/block_pool.py) pops the first free block
// as null_block, and block tables carry NULL_BLOCK_ID = 0
// (vllm/v1/attention/backends/utils.py; the store scheduler and worker,
// .../mooncake/store/scheduler.py and worker.py, import it to skip null
// entries). Engines that send JSON null keep the default (no declaration).

// nullOf is a declared null block id.
func nullOf(v int64) *int64 { return &v }

// decodeTable decodes a JSON block table.
func decodeTable(t *testing.T, s string) BlockTable {
	t.Helper()
	var tb BlockTable
	if err := json.Unmarshal([]byte(s), &tb); err != nil {
		t.Fatalf("decode %s: %v", s, err)
	}
	return tb
}

func TestScenariosNull(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S80_vllm_null_zero_normalises_to_null", scenarioNullZero},
		{"S81_default_keeps_block_zero_real", scenarioNullDefault},
		{"S82_json_null_stays_null_under_a_declared_id", scenarioNullJSONAndDeclared},
		{"S83_other_declared_id", scenarioNullOtherID},
		{"S84_declared_null_is_never_saved", scenarioNullNeverSaved},
		{"S85_declared_null_is_never_loaded", scenarioNullNeverLoaded},
		{"S86_engine_null_block", scenarioEngineNullBlock},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}

// S80: a vLLM table under null id 0: [[0,0,5,6],[0,7]] (Mamba states
// before the hit are the null block) is [[null,null,5,6],[null,7]], and the
// engine's table is left as it was.
func scenarioNullZero(t *testing.T) {
	in := decodeTable(t, `[[0,0,5,6],[0,7]]`)
	got := in.NormalizeNull(EngineNullBlock(nullOf(0)))
	if want := tbl([]BlockID{NullBlock, NullBlock, 5, 6}, []BlockID{NullBlock, 7}); !reflect.DeepEqual(got, want) {
		t.Fatalf("NormalizeNull(0) = %v, want %v", got, want)
	}
	if b, _ := json.Marshal(got); string(b) != `[[null,null,5,6],[null,7]]` {
		t.Fatalf("normalised JSON %s", b)
	}
	if want := tbl([]BlockID{0, 0, 5, 6}, []BlockID{0, 7}); !reflect.DeepEqual(in, want) {
		t.Fatalf("the engine's table changed: %v", in)
	}
}

// S81: without a declaration (JSON-null convention) block 0 is a real
// block: [[0,1],[2]] stays [[0,1],[2]].
func scenarioNullDefault(t *testing.T) {
	in := decodeTable(t, `[[0,1],[2]]`)
	got := in.NormalizeNull(EngineNullBlock(nil))
	if want := tbl([]BlockID{0, 1}, []BlockID{2}); !reflect.DeepEqual(got, want) {
		t.Fatalf("NormalizeNull(default) = %v, want %v", got, want)
	}
}

// S82: JSON null is null under any declaration: [[null,0,3]] under null id
// 0 is [[null,null,3]].
func scenarioNullJSONAndDeclared(t *testing.T) {
	got := decodeTable(t, `[[null,0,3]]`).NormalizeNull(0)
	if want := tbl([]BlockID{NullBlock, NullBlock, 3}); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// S83: an engine whose null id is 4096 (one past a 4096-block pool) keeps
// block 0 real: [[4096,0,1]] is [[null,0,1]]; an empty group stays empty.
func scenarioNullOtherID(t *testing.T) {
	got := decodeTable(t, `[[4096,0,1],[]]`).NormalizeNull(4096)
	if want := tbl([]BlockID{NullBlock, 0, 1}, []BlockID{}); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// S84: dense model, bs 16. The engine (null id 0) schedules 32 new tokens
// on [[0,1]]: block index 0 is the null block, so the save of [0,32) leaves
// chunk [0,16) out (vLLM's sending thread skips an unavailable source
// block, worker.py KVCacheStoreSendingThread._handle_request) and lists
// only [16,32), which is valid; a task that lists the null block's chunk
// anyway is refused null_block. The same table from a JSON-null engine
// names block 0, a real block: both chunks are saved.
func scenarioNullNeverSaved(t *testing.T) {
	m := trkDense(t)
	for _, tc := range []struct {
		name   string
		null   BlockID
		chunks []Chunk
	}{
		{"declared 0", 0, []Chunk{{16, 32}}},
		{"default", NullBlock, []Chunk{{0, 16}, {16, 32}}},
	} {
		tr := NewTracker(m, "e1", "r1")
		tr.OnAdmit(trkHashes(2), 0)
		eff := noErr(t, tr.Step(m, Step{Kind: StepNew, Tokens: 32, Table: tbl([]BlockID{0, 1}).NormalizeNull(tc.null)}))
		if len(eff.Saves) != 1 || !slices.Equal(eff.Saves[0].Groups[0].Chunks, tc.chunks) {
			t.Fatalf("%s: saves %+v, want one listing %v", tc.name, eff.Saves, tc.chunks)
		}
		v := ValidateSave(m, []int{8}, &eff.Saves[0])
		if len(v) != 1 || v[0].Reason != ReasonOK {
			t.Fatalf("%s: verdicts %+v, want valid", tc.name, v)
		}
		forged := eff.Saves[0]
		forged.Groups = []GroupChunks{{Group: 0, Chunks: m.SaveChunks(0, 0, 32)}}
		want := ReasonOK
		if tc.null == 0 {
			want = ReasonNullBlock
		}
		if v := ValidateSave(m, []int{8}, &forged); len(v) != 1 || v[0].Reason != want {
			t.Fatalf("%s: task listing every chunk: verdicts %+v, want %q", tc.name, v, want)
		}
	}
}

// S85: a load of [0,32) into [[0,9]] from an engine with null id 0 never
// names block 0: its load-error list is [9]; under the default it is [0,9].
func scenarioNullNeverLoaded(t *testing.T) {
	m := trkDense(t)
	task := func(null BlockID) *LoadTask {
		return &LoadTask{BlockTable: tbl([]BlockID{0, 9}).NormalizeNull(null),
			Groups: []GroupChunks{{Group: 0, Chunks: m.SaveChunks(0, 0, 32)}}}
	}
	if got := ListedBlocks(m, task(0)); !slices.Equal(got, []BlockID{9}) {
		t.Fatalf("declared 0: listed %v, want [9]", got)
	}
	if got := ListedBlocks(m, task(NullBlock)); !slices.Equal(got, []BlockID{0, 9}) {
		t.Fatalf("default: listed %v, want [0 9]", got)
	}
}

// S86: no declaration is NullBlock; a declaration is its id.
func scenarioEngineNullBlock(t *testing.T) {
	if got := EngineNullBlock(nil); got != NullBlock {
		t.Fatalf("EngineNullBlock(nil) = %d", got)
	}
	if got := EngineNullBlock(nullOf(0)); got != 0 {
		t.Fatalf("EngineNullBlock(0) = %d", got)
	}
	var nilTable BlockTable
	if got := nilTable.NormalizeNull(0); got != nil {
		t.Fatalf("nil table normalised to %v", got)
	}
}
