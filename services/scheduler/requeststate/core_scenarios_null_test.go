package requeststate

import (
	"encoding/json"
	"reflect"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// S80: a vLLM table under null id 0: [[0,0,5,6],[0,7]] (Mamba states
// before the hit are the null block) is [[null,null,5,6],[null,7]], and the
// engine's table is left as it was.
func scenarioNullZero(t *testing.T) {
	in := decodeTable(t, `[[0,0,5,6],[0,7]]`)
	got := in.NormalizeNull(kvcore.EngineNullBlock(nullOf(0)))
	if want := tbl([]kvcore.BlockID{kvcore.NullBlock, kvcore.NullBlock, 5, 6}, []kvcore.BlockID{kvcore.NullBlock, 7}); !reflect.DeepEqual(got, want) {
		t.Fatalf("NormalizeNull(0) = %v, want %v", got, want)
	}
	if b, _ := json.Marshal(got); string(b) != `[[null,null,5,6],[null,7]]` {
		t.Fatalf("normalised JSON %s", b)
	}
	if want := tbl([]kvcore.BlockID{0, 0, 5, 6}, []kvcore.BlockID{0, 7}); !reflect.DeepEqual(in, want) {
		t.Fatalf("the engine's table changed: %v", in)
	}
}

// S81: without a declaration (JSON-null convention) block 0 is a real
// block: [[0,1],[2]] stays [[0,1],[2]].
func scenarioNullDefault(t *testing.T) {
	in := decodeTable(t, `[[0,1],[2]]`)
	got := in.NormalizeNull(kvcore.EngineNullBlock(nil))
	if want := tbl([]kvcore.BlockID{0, 1}, []kvcore.BlockID{2}); !reflect.DeepEqual(got, want) {
		t.Fatalf("NormalizeNull(default) = %v, want %v", got, want)
	}
}

// S82: JSON null is null under any declaration: [[null,0,3]] under null id
// 0 is [[null,null,3]].
func scenarioNullJSONAndDeclared(t *testing.T) {
	got := decodeTable(t, `[[null,0,3]]`).NormalizeNull(0)
	if want := tbl([]kvcore.BlockID{kvcore.NullBlock, kvcore.NullBlock, 3}); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// S83: an engine whose null id is 4096 (one past a 4096-block pool) keeps
// block 0 real: [[4096,0,1]] is [[null,0,1]]; an empty group stays empty.
func scenarioNullOtherID(t *testing.T) {
	got := decodeTable(t, `[[4096,0,1],[]]`).NormalizeNull(4096)
	if want := tbl([]kvcore.BlockID{kvcore.NullBlock, 0, 1}, []kvcore.BlockID{}); !reflect.DeepEqual(got, want) {
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
		null   kvcore.BlockID
		chunks []kvcore.Chunk
	}{
		{"declared 0", 0, []kvcore.Chunk{{Start: 16, End: 32}}},
		{"default", kvcore.NullBlock, []kvcore.Chunk{{Start: 0, End: 16}, {Start: 16, End: 32}}},
	} {
		tr := NewTracker(m, "e1", "r1")
		tr.OnAdmit(trkHashes(2), 0)
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl([]kvcore.BlockID{0, 1}).NormalizeNull(tc.null)}))
		if len(eff.Saves) != 1 || !slices.Equal(eff.Saves[0].Groups[0].Chunks, tc.chunks) {
			t.Fatalf("%s: saves %+v, want one listing %v", tc.name, eff.Saves, tc.chunks)
		}
		v := kvcore.ValidateSave(m, []int{8}, &eff.Saves[0])
		if len(v) != 1 || v[0].Reason != kvcore.ReasonOK {
			t.Fatalf("%s: verdicts %+v, want valid", tc.name, v)
		}
		forged := eff.Saves[0]
		forged.Groups = []kvcore.GroupChunks{{Group: 0, Chunks: m.SaveChunks(0, 0, 32)}}
		want := kvcore.ReasonOK
		if tc.null == 0 {
			want = kvcore.ReasonNullBlock
		}
		if v := kvcore.ValidateSave(m, []int{8}, &forged); len(v) != 1 || v[0].Reason != want {
			t.Fatalf("%s: task listing every chunk: verdicts %+v, want %q", tc.name, v, want)
		}
	}
}

// S85: a load of [0,32) into [[0,9]] from an engine with null id 0 never
// names block 0: its load-error list is [9]; under the default it is [0,9].
func scenarioNullNeverLoaded(t *testing.T) {
	m := trkDense(t)
	task := func(null kvcore.BlockID) *kvcore.LoadTask {
		return &kvcore.LoadTask{BlockTable: tbl([]kvcore.BlockID{0, 9}).NormalizeNull(null),
			Groups: []kvcore.GroupChunks{{Group: 0, Chunks: m.SaveChunks(0, 0, 32)}}}
	}
	if got := kvcore.ListedBlocks(m, task(0)); !slices.Equal(got, []kvcore.BlockID{9}) {
		t.Fatalf("declared 0: listed %v, want [9]", got)
	}
	if got := kvcore.ListedBlocks(m, task(kvcore.NullBlock)); !slices.Equal(got, []kvcore.BlockID{0, 9}) {
		t.Fatalf("default: listed %v, want [0 9]", got)
	}
}

func TestScenariosNullTracker(t *testing.T) {
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
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}
