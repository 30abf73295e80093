package e2e

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestPartialHashHits plays the partial-hash-hit preset
// (hybrid-mla-linear-partial: MLA 64 + linear attention 64, hash block 16)
// through the real mesh with the store connector alone, then replays it on
// a fresh engine with the same salt (so that it loads from the store):
// every request ok,
// every loaded block right byte for byte (sub-block chunks included), the
// save ledger balanced, some store loads ending inside a block (a hit on a
// prompt tail, read from its tail key) and some prompt-tail saves, none
// dead-lettered.
func TestPartialHashHits(t *testing.T) {
	const partial = "hybrid-mla-linear-partial"
	s := newStack(t, stackOptions{model: partial, connectors: "store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := smallWorkload(24, 6)
	w.SystemPrompts = 4
	cfg := simConfig(t, s, false, w)
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	// Whether the first run itself loads from the store depends on its
	// timing (its local cache may hold every prefix); a replay on a fresh
	// engine with the same salt must.
	replay := requireStoreLoads(ctx, t, s, cfg)
	for _, r := range []*sim.Report{rep, replay} {
		if r.Verification.Mismatched != 0 || r.Ledger.DeadLettered != 0 {
			t.Fatalf("%d mismatched blocks, %d dead-lettered keys; want none", r.Verification.Mismatched, r.Ledger.DeadLettered)
		}
	}
	m, err := kvcore.Preset(partial)
	if err != nil {
		t.Fatal(err)
	}
	sbs := m.SchedulerBlockSize()
	loads, err := sim.ReadAll(ctx, s.brokers, contract.TopicLoadTasks)
	if err != nil {
		t.Fatal(err)
	}
	inside := 0
	for _, rec := range loads {
		var task kvcore.LoadTask
		if err := json.Unmarshal(rec.Value, &task); err != nil {
			t.Fatalf("load task at %d/%d: %v", rec.Partition, rec.Offset, err)
		}
		if task.Connector == "store" && task.End%sbs != 0 {
			inside++
		}
	}
	saves, err := sim.ReadAll(ctx, s.brokers, contract.TopicSaveTasks)
	if err != nil {
		t.Fatal(err)
	}
	tails := 0
	for _, rec := range saves {
		task, err := kvcore.DecodeSaveTask(rec.Value)
		if err != nil {
			t.Fatalf("save task at %d/%d: %v", rec.Partition, rec.Offset, err)
		}
		if task.End%sbs != 0 {
			tails++
		}
	}
	if inside == 0 || tails == 0 {
		t.Fatalf("%d store loads ending inside a block, %d prompt-tail saves: want some of each", inside, tails)
	}
	t.Logf("%d store loads ending inside a block, %d prompt-tail saves", inside, tails)
}
