package sending_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending/sendingtest"
)

// TestTaskRedeliveredToAFreshProcessorIsADuplicate: a task whose outcome is
// in PostgreSQL is delivered again, the same record, to a processor that
// never handled it (another sender after a rebalance, or this one
// restarted: its recent set is empty). It is saved again — keys the store
// still holds are not put; keys it lost are put again from the blocks,
// which the worker checks still hold their chunks — and dropped at commit:
// the first delivery's outcome kept, no second result or KV event, no dead
// letter (though a reused block dead-letters its group), counted a
// duplicate. A second copy of the record (the outbox relay published it
// twice) then finds the task in the processor's recent set: no put.
func TestTaskRedeliveredToAFreshProcessorIsADuplicate(t *testing.T) {
	ref := func(g int, b kvcore.BlockID) dataplane.BlockRef { return dataplane.BlockRef{Group: g, Block: b} }
	cases := []struct {
		name    string
		evicted bool // the store lost the task's keys before the redelivery
		reused  bool // the engine reused the task's blocks for other chunks
	}{
		{"keys still stored: nothing put", false, false},
		{"keys evicted: put again, the same bytes", true, false},
		{"keys evicted, blocks reused: nothing stored", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			pool := dbtest.NewPool(t)
			store := kvstore.NewMemory(kvstore.MemoryOptions{})
			first := newFixture(t, pool, store)
			// Tokens [0, 64) in blocks 10..13 of each group: group 0 (MLA)
			// saves four chunks, group 1 (Mamba) the state in block 13.
			task := saveTask(first.model, "again", 0, 64, 10)
			rec := first.handle(t, encode(t, task))
			want, ok := first.outcome(t, task.TaskID)
			if !ok || want.Status != "stored" {
				t.Fatalf("first delivery: %+v, want stored", want)
			}
			results, events := len(first.outbox(t, contract.TopicTransferResults)), len(first.outbox(t, contract.TopicKVEvents))
			keys := append(first.keysOf(t, task, 0), first.keysOf(t, task, 1)...)
			if tc.evicted {
				if _, err := store.Remove(ctx, keys); err != nil {
					t.Fatal(err)
				}
			}

			second := newFixture(t, pool, store)
			if tc.reused {
				second.worker.setNotHeld(ref(0, 10), ref(0, 11), ref(0, 12), ref(0, 13), ref(1, 13))
			}
			second.deliver(t, rec) // the same record, redelivered
			asked := second.worker.asked()
			wantPuts := 0
			if tc.evicted {
				wantPuts = len(keys)
			}
			if len(asked) != wantPuts {
				t.Fatalf("redelivery put %d items, want %d", len(asked), wantPuts)
			}
			for _, it := range asked {
				if hi := int(it.Block - 10); it.Hash != task.BlockHashes[hi] {
					t.Fatalf("put item %+v without its chunk's hash %s", it, task.BlockHashes[hi])
				}
			}
			second.deliver(t, second.record(rec.Value)) // the same task in another record
			if n := len(second.worker.asked()); n != len(asked) {
				t.Errorf("the second copy put %d more items, want none", n-len(asked))
			}

			got, ok := second.outcome(t, task.TaskID)
			if !ok || got.Status != want.Status || !equalGroups(got.Groups, want.Groups) {
				t.Errorf("outcome %+v, want the first delivery's %+v", got, want)
			}
			var rows int
			var offset int64
			if err := pool.QueryRow(ctx, `SELECT count(*), min("offset") FROM save_outcomes WHERE task_id = $1`, task.TaskID).Scan(&rows, &offset); err != nil || rows != 1 || offset != rec.Offset {
				t.Errorf("save_outcomes: %d rows from offset %d (%v), want 1 from %d", rows, offset, err, rec.Offset)
			}
			if n := len(second.outbox(t, contract.TopicTransferResults)); n != results {
				t.Errorf("%d transfer results, want the first delivery's %d", n, results)
			}
			if n := len(second.outbox(t, contract.TopicKVEvents)); n != events {
				t.Errorf("%d kv event records, want the first delivery's %d", n, events)
			}
			if n := len(second.outbox(t, contract.TopicSaveDLQ)); n != 0 {
				t.Errorf("%d dlq messages, want none", n)
			}
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM dead_letters`).Scan(&rows); err != nil || rows != 0 {
				t.Errorf("%d dead letters (%v), want none", rows, err)
			}
			if n := sendingtest.Counter(t, second.reg, duplicates); n != 2 {
				t.Errorf("%s = %v, want 2 (one found at commit, one in the recent set)", duplicates, n)
			}
			if n := sendingtest.Counter(t, second.reg, "kvmesh_sender_tasks_total"); n != 0 {
				t.Errorf("tasks counted = %v, want 0", n)
			}
			if n := sendingtest.Counter(t, second.reg, "kvmesh_dead_letters_total"); n != 0 {
				t.Errorf("dead letters counted = %v, want 0", n)
			}

			// What the store holds: the first delivery's bytes, put again
			// from the same blocks; nothing from a reused block.
			blocks := map[int][]kvcore.BlockID{0: {10, 11, 12, 13}, 1: {13}}
			for g := range first.model.Groups {
				gk := first.keysOf(t, task, g)
				values, errs, err := store.Get(ctx, gk)
				if err != nil {
					t.Fatal(err)
				}
				for i := range gk {
					if tc.reused {
						if errs[i] == nil {
							t.Errorf("group %d key %d stored from a reused block", g, i)
						}
						continue
					}
					payload, err := dataplane.DecodeValue(first.model.Fingerprint(), values[i])
					if errs[i] != nil || err != nil || !bytes.Equal(payload, blockBytes(first.model, g, blocks[g][i])) {
						t.Errorf("group %d key %d: %v, %v; want block %d's bytes", g, i, errs[i], err, blocks[g][i])
					}
				}
			}
		})
	}
}
