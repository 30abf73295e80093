package sending_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

func TestDryRunSaysWhatAReplayWouldDo(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	broken := kvstore.NewMemory(kvstore.MemoryOptions{})
	_ = broken.Close()
	down := newFixture(t, pool, broken)
	seed := saveTask(down.model, "seed", 0, 32, 0)
	seed.BlockTable = seed.BlockTable[:1]
	seedDL := down.deadLetters(t, down.handle(t, encode(t, seed)).Offset)
	flaky := saveTask(down.model, "flaky", 0, 32, 4)
	var group1 deadletter.DeadLetter
	for _, d := range down.deadLetters(t, down.handle(t, encode(t, flaky)).Offset) {
		if d.Reason == "exists_failed" && *d.Group == 1 {
			group1 = d
		}
	}
	if len(seedDL) == 0 || seedDL[0].Reason != "table_group_count" || group1.ID == 0 {
		t.Fatalf("setup: seed dead letters %+v, flaky group 1 %+v", seedDL, group1)
	}
	up := newFixture(t, pool, kvstore.NewMemory(kvstore.MemoryOptions{}))
	noWorker := newFixture(t, pool, up.store, func(o *sending.Options) { o.Workers = engines{} })
	outboxBefore := len(up.outbox(t, contract.TopicKVEvents))
	missingKey := up.keysOf(t, flaky, 1)[0]

	tests := []struct {
		name       string
		f          *fixture
		id         int64
		replayable bool
		expect     string
		reason     string
		exists     string // "missing", "unknown" or "" (no keys)
	}{
		{"still invalid", up, seedDL[0].ID, false, sending.ExpectInvalid, "table_group_count", ""},
		{"valid, store and worker up", up, group1.ID, true, sending.ExpectSave, "", "missing"},
		{"valid, no live worker", noWorker, group1.ID, true, sending.ExpectFail, "put_failed", "missing"},
		{"valid, store down", down, group1.ID, true, sending.ExpectFail, "exists_failed", "unknown"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dr, err := tt.f.p.DryRun(ctx, tt.id)
			if err != nil {
				t.Fatal(err)
			}
			if dr.Replayable != tt.replayable || dr.Expect != tt.expect || dr.Reason != tt.reason || dr.DeadLetter.ID != tt.id {
				t.Fatalf("dry run %+v, want replayable %v expect %q reason %q", dr, tt.replayable, tt.expect, tt.reason)
			}
			if tt.exists == "" {
				if len(dr.Groups) != 0 || dr.Group == nil || *dr.Group != 1 {
					t.Fatalf("invalid dry run lists groups %+v or misses the invalid group %v", dr.Groups, dr.Group)
				}
				return
			}
			if len(dr.Groups) != 1 || dr.Groups[0].Group != 1 || len(dr.Groups[0].Keys) != 1 {
				t.Fatalf("groups %+v, want group 1 with its one key", dr.Groups)
			}
			k := dr.Groups[0].Keys[0]
			last := flaky.BlockTable[1][len(flaky.BlockTable[1])-1] // the mamba group saves its last block
			if k.Key != missingKey || k.Rank != "tp0-pcp0-dcp0-pp0" || k.Block != last {
				t.Fatalf("key %+v, want %s of block %d", k, missingKey, last)
			}
			if got := existsWord(k.Exists); got != tt.exists {
				t.Fatalf("exists = %s, want %s", got, tt.exists)
			}
		})
	}

	// A block of the missing key reused for another chunk: a replay would be
	// refused, and the dry run says so.
	last := flaky.BlockTable[1][len(flaky.BlockTable[1])-1]
	up.worker.setNotHeld(dataplane.BlockRef{Group: 1, Block: last})
	dr, err := up.p.DryRun(ctx, group1.ID)
	if err != nil || dr.Expect != sending.ExpectFail || dr.Reason != "block_not_held" || !strings.Contains(dr.Detail, "holds another chunk") {
		t.Fatalf("dry run of a reused block: %+v, %v; want fail with block_not_held", dr, err)
	}
	up.worker.setNotHeld()

	// Nothing was saved, recorded or published by the dry runs.
	if d, err := up.ledger.Get(ctx, group1.ID); err != nil || d.ReplayStatus != deadletter.ReplayNone || d.ReplayCount != 0 {
		t.Fatalf("entry after dry runs: %+v, %v", d, err)
	}
	if _, errs, _ := up.store.Get(ctx, []string{missingKey}); !errors.Is(errs[0], kvstore.ErrNotFound) {
		t.Fatalf("a dry run stored the key: %v", errs[0])
	}
	if up.worker.puts != 0 || len(up.outbox(t, contract.TopicKVEvents)) != outboxBefore {
		t.Fatalf("a dry run put %d times or published", up.worker.puts)
	}

	if _, err := up.p.Replay(ctx, group1.ID); err != nil {
		t.Fatal(err)
	}
	dr, err = up.p.DryRun(ctx, group1.ID)
	if err != nil || dr.Replayable || dr.Expect != sending.ExpectAlreadyReplayed {
		t.Fatalf("dry run after the replay: %+v, %v", dr, err)
	}
	if _, err := up.p.DryRun(ctx, 999999); !errors.Is(err, deadletter.ErrNotFound) {
		t.Fatalf("dry run of an unknown id: %v", err)
	}
}

func existsWord(b *bool) string {
	switch {
	case b == nil:
		return "unknown"
	case *b:
		return "present"
	}
	return "missing"
}
