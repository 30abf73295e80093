package kvcore

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"testing"
)

// taskJSONStrings are strings AppendJSON must quote as encoding/json does:
// the plain ones it writes itself, the rest it hands over.
var taskJSONStrings = []string{"", "e1", "req-7", "0a1b2c3d", "a\"b", `back\slash`, "<html>&", "tab\there", "nl\n", "\x00", "é", "日本", "\u2028\u2029", "bad\xffutf8", "\x7f"}

func randString(r *rand.Rand) string { return taskJSONStrings[r.IntN(len(taskJSONStrings))] }

func randTable(r *rand.Rand) BlockTable {
	switch r.IntN(5) {
	case 0:
		return nil
	case 1:
		return BlockTable{}
	}
	t := make(BlockTable, r.IntN(4))
	for g := range t {
		if r.IntN(6) == 0 {
			continue // nil group
		}
		t[g] = make([]BlockID, r.IntN(6))
		for i := range t[g] {
			t[g][i] = BlockID(r.Int64N(1<<40) - 1) // NullBlock among them
			if r.IntN(4) == 0 {
				t[g][i] = NullBlock
			}
		}
	}
	return t
}

func randStrings(r *rand.Rand) []string {
	switch r.IntN(4) {
	case 0:
		return nil
	case 1:
		return []string{}
	}
	out := make([]string, r.IntN(5))
	for i := range out {
		out[i] = randString(r)
	}
	return out
}

func randGroups(r *rand.Rand) []GroupChunks {
	switch r.IntN(4) {
	case 0:
		return nil
	case 1:
		return []GroupChunks{}
	}
	out := make([]GroupChunks, r.IntN(3)+1)
	for i := range out {
		out[i].Group = r.IntN(4) - 1
		if r.IntN(4) > 0 {
			out[i].Chunks = make([]Chunk, r.IntN(4))
			for j := range out[i].Chunks {
				out[i].Chunks[j] = Chunk{Start: r.IntN(1 << 20), End: r.IntN(1<<20) - 5}
			}
		}
	}
	return out
}

func randSaveTask(r *rand.Rand) *SaveTask {
	t := &SaveTask{Schema: SchemaSaveTask, TaskID: randString(r), EngineID: randString(r), RequestID: randString(r),
		Model: randString(r), Tenant: randString(r), Epoch: r.IntN(3) - 1, Start: r.IntN(4096), End: r.IntN(4096) - 3,
		BlockTable: randTable(r), BlockHashes: randStrings(r), LoraName: randString(r), Groups: randGroups(r)}
	switch r.IntN(3) {
	case 0:
		t.TokenIDs = []uint32{}
	case 1:
		t.TokenIDs = make([]uint32, r.IntN(40))
		for i := range t.TokenIDs {
			t.TokenIDs[i] = r.Uint32()
		}
	}
	return t
}

func randLoadTask(r *rand.Rand) *LoadTask {
	t := &LoadTask{Schema: SchemaLoadTask, TaskID: randString(r), EngineID: randString(r), RequestID: randString(r),
		Model: randString(r), Tenant: randString(r), Connector: randString(r), Epoch: r.IntN(3) - 1, Start: r.IntN(4096),
		End: r.IntN(4096), BlockTable: randTable(r), BlockHashes: randStrings(r), Groups: randGroups(r)}
	if r.IntN(2) == 0 {
		t.Remote = &RemoteSource{EngineID: randString(r), BlockTable: randTable(r)}
	}
	switch r.IntN(3) {
	case 0:
		t.Ranks = []Rank{}
	case 1:
		t.Ranks = make([]Rank, r.IntN(4)+1)
		for i := range t.Ranks {
			t.Ranks[i] = Rank{TP: r.IntN(8), PCP: r.IntN(2), DCP: r.IntN(2), PP: r.IntN(3) - 1}
		}
	}
	return t
}

// TestTaskAppendJSONIsEncodingJSON holds SaveTask.AppendJSON and
// LoadTask.AppendJSON to encoding/json's bytes for the same task.
func TestTaskAppendJSONIsEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	prefix := []byte("prefix")
	for i := range 5000 {
		st := randSaveTask(r)
		want, err := json.Marshal(st)
		if err != nil {
			t.Fatal(err)
		}
		if got := st.MarshalJSONFast(); !bytes.Equal(got, want) {
			t.Fatalf("save task %d:\n got %s\nwant %s", i, got, want)
		}
		if got := st.AppendJSON(bytes.Clone(prefix)); !bytes.Equal(got, append(bytes.Clone(prefix), want...)) {
			t.Fatalf("save task %d appended to a prefix: %s", i, got)
		}
		lt := randLoadTask(r)
		if want, err = json.Marshal(lt); err != nil {
			t.Fatal(err)
		}
		if got := lt.AppendJSON(nil); !bytes.Equal(got, want) {
			t.Fatalf("load task %d:\n got %s\nwant %s", i, got, want)
		}
	}
}

// benchSaveTask is a save task of the seed's shape: two groups, a 4K
// prompt of 16-token blocks with its hash chain and token ids.
func benchSaveTask() *SaveTask {
	const blocks = 256
	t := &SaveTask{Schema: SchemaSaveTask, TaskID: "save-e1-req-00042-0-0-4096", EngineID: "prefill-0", RequestID: "req-00042",
		Model: "hybrid-mla-linear", Start: 0, End: blocks * 16, BlockTable: BlockTable{make([]BlockID, blocks), make([]BlockID, blocks)},
		BlockHashes: make([]string, blocks), TokenIDs: make([]uint32, blocks*16),
		Groups: []GroupChunks{{Group: 0, Chunks: Chunks(0, blocks*16, 16)}, {Group: 1, Chunks: Chunks(0, blocks*16, 64)}}}
	for i := range blocks {
		t.BlockTable[0][i], t.BlockTable[1][i] = BlockID(1000+i), BlockID(5000+i)
		t.BlockHashes[i] = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	}
	for i := range t.TokenIDs {
		t.TokenIDs[i] = uint32(i*7919) % 151936
	}
	return t
}

func BenchmarkEncodeSaveTask(b *testing.B) {
	t := benchSaveTask()
	b.Run("encoding_json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := json.Marshal(t); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("append_json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = t.MarshalJSONFast()
		}
	})
}
