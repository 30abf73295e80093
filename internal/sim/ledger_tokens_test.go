package sim

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// tokenRecord is a BlockStored record of request run-1 whose one event
// names the blocks keyed by the fixture's hashes at chain indexes idx
// (16-token blocks) and carries tokens.
func (f *ledgerFixture) tokenRecord(idx []int, tokens []uint32) Record {
	f.t.Helper()
	var wire []uint64
	var hexes []string
	for _, i := range idx {
		b, err := kvcore.ParseBlockHash(f.hashes[i])
		if err != nil {
			f.t.Fatal(err)
		}
		wire, hexes = append(wire, contract.WireHash(b)), append(hexes, f.hashes[i])
	}
	kb := kvcore.KeysOf(f.m)
	key, value, headers, err := contract.EncodeKVEventRecord(contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: 1, Events: []contract.KVEvent{{Kind: contract.BlockStored, BlockHashes: wire,
			TokenIDs: tokens, BlockSize: 16}}},
		Namespace: kb.Namespace(kvcore.Rank{}, 0), Hashes: hexes, EngineID: "e", RequestID: "run-1", Model: f.m.Name,
	}, contract.KVEventFormMap)
	if err != nil {
		f.t.Fatal(err)
	}
	return Record{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers}
}

// TestLedgerChecksEventTokens: a BlockStored event's token_ids must be
// exactly its blocks' prompt tokens, as the request's save tasks carried
// them, whichever of the event and the task is read first.
func TestLedgerChecksEventTokens(t *testing.T) {
	prompt := make([]uint32, 64)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	cases := []struct {
		name     string
		idx      []int
		tokens   []uint32
		balanced bool
	}{
		{"the blocks' tokens", []int{1, 2}, prompt[16:48], true},
		{"no tokens", []int{1, 2}, []uint32{}, true},
		{"tokens shifted by a block", []int{1, 2}, prompt[0:32], false},
		{"fewer tokens than blocks", []int{1, 2}, prompt[16:32], false},
		{"a block past the task's tokens", []int{3, 4}, append(append([]uint32(nil), prompt[48:64]...), prompt[0:16]...), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newLedgerFixture(t)
			f.l.kvEvent(f.tokenRecord(c.idx, c.tokens)) // before its task
			task := kvcore.SaveTask{
				Schema: kvcore.SchemaSaveTask, TaskID: "t1", EngineID: "e", RequestID: "run-1", Model: f.m.Name, Start: 0, End: 80,
				BlockTable: kvcore.BlockTable{make([]kvcore.BlockID, 5), make([]kvcore.BlockID, 5)}, BlockHashes: f.hashes[:5],
				TokenIDs: prompt, Groups: f.m.SaveGroups(0, 80),
			}
			f.l.saveTask(Record{Key: "run-1", Value: mustJSON(task)})
			f.l.expectSave("e", "run-1", span{0, 80})
			f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 5}, contract.GroupOutcome{Group: 1, Stored: 1})
			rep := f.l.report()
			if rep.Balanced != c.balanced {
				t.Fatalf("balanced %v, want %v: %+v", rep.Balanced, c.balanced, rep.Differences)
			}
			if want := min(1, len(c.tokens)); rep.TokenEvents != want {
				t.Fatalf("token events %d, want %d", rep.TokenEvents, want)
			}
		})
	}
}
