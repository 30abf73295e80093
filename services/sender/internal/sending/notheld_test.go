package sending_test

import (
	"context"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestBlocksNotHeldAreDeadLetteredPerGroup has the worker answer not_held
// for some blocks of a save: each group with such blocks gets one dead
// letter with reason block_not_held naming the block, its refused keys are
// not stored (and not in its kv event), its other keys and the other
// groups are stored, and the result is still recorded. Every put names the
// chunk's hash and the saving request.
func TestBlocksNotHeldAreDeadLetteredPerGroup(t *testing.T) {
	ref := func(g int, b kvcore.BlockID) dataplane.BlockRef { return dataplane.BlockRef{Group: g, Block: b} }
	// The task: tokens [0, 64) in blocks 10..13 of each group; group 0 (MLA)
	// saves all four chunks, group 1 (Mamba) only the state in block 13.
	cases := []struct {
		name     string
		notHeld  []dataplane.BlockRef
		want     []contract.GroupOutcome
		dlGroups []int
	}{
		{"one block of group 0", []dataplane.BlockRef{ref(0, 11)},
			[]contract.GroupOutcome{{Group: 0, Stored: 3, DeadLettered: 1, Reason: "block_not_held"}, {Group: 1, Stored: 1}}, []int{0}},
		{"blocks of both groups", []dataplane.BlockRef{ref(0, 10), ref(0, 13), ref(1, 13)},
			[]contract.GroupOutcome{{Group: 0, Stored: 2, DeadLettered: 2, Reason: "block_not_held"}, {Group: 1, DeadLettered: 1, Reason: "block_not_held"}}, []int{0, 1}},
		{"a block no chunk uses", []dataplane.BlockRef{ref(1, 10)},
			[]contract.GroupOutcome{{Group: 0, Stored: 4}, {Group: 1, Stored: 1}}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
			f.worker.setNotHeld(tc.notHeld...)
			task := saveTask(f.model, "nh", 0, 64, 10)
			rec := f.handle(t, encode(t, task))

			res, ok := f.outcome(t, task.TaskID)
			if !ok {
				t.Fatal("no outcome recorded")
			}
			wantStatus := "stored"
			if len(tc.dlGroups) > 0 {
				wantStatus = "dead_lettered"
			}
			if res.Status != wantStatus || !equalGroups(res.Groups, tc.want) {
				t.Fatalf("result %+v, want %s %+v", res, wantStatus, tc.want)
			}
			if n := len(f.outbox(t, contract.TopicTransferResults)); n != 1 {
				t.Fatalf("%d transfer results, want 1", n)
			}
			dls := f.deadLetters(t, rec.Offset)
			if len(dls) != len(tc.dlGroups) {
				t.Fatalf("%d dead letters, want %d: %+v", len(dls), len(tc.dlGroups), dls)
			}
			for i, d := range dls {
				if d.Reason != kvcore.ReasonBlockNotHeld || d.Group == nil || *d.Group != tc.dlGroups[i] ||
					d.TaskID != task.TaskID || d.RequestID != task.RequestID || !strings.Contains(d.Detail, "no longer hold") {
					t.Fatalf("dead letter %d: %+v", i, d)
				}
			}
			if n := len(f.outbox(t, contract.TopicSaveDLQ)); n != len(tc.dlGroups) {
				t.Fatalf("%d dlq messages, want %d", n, len(tc.dlGroups))
			}

			refused := map[dataplane.BlockRef]bool{}
			for _, r := range tc.notHeld {
				refused[r] = true
			}
			storedKeys := map[int]map[string]bool{}
			recs, _ := f.kvRecords(t)
			for _, e := range recs {
				g := *e.Batch.Events[0].GroupIdx
				if storedKeys[g] == nil {
					storedKeys[g] = map[string]bool{}
				}
				for _, k := range e.Keys() {
					storedKeys[g][k] = true
				}
			}
			for g := range f.model.Groups {
				items, err := kvcore.PlanSend(f.model, f.keys, task, g, kvcore.Rank{})
				if err != nil {
					t.Fatal(err)
				}
				for _, it := range items {
					found, err := f.store.Exists(context.Background(), []string{it.Key})
					if err != nil {
						t.Fatal(err)
					}
					held := !refused[ref(g, it.Block)]
					if found[0] != held || storedKeys[g][it.Key] != held {
						t.Fatalf("group %d block %d: stored %v, in kv event %v; want %v", g, it.Block, found[0], storedKeys[g][it.Key], held)
					}
				}
			}
			for _, it := range f.worker.asked() {
				hi := it.Block - 10 // block 10+i holds chunk i, hash index i (bs 16 = hash block size)
				if it.Hash != task.BlockHashes[hi] || it.RequestID != task.RequestID {
					t.Fatalf("put item %+v: want hash %s, request %s", it, task.BlockHashes[hi], task.RequestID)
				}
			}
		})
	}
}
