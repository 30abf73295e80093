package requeststate

import (
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// rankLoad starts a TP2 MLA + Mamba request with an accepted 32-token load
// and returns its tracker and the load task.
func rankLoad(t *testing.T) (*kvcore.Model, *Tracker, kvcore.LoadTask) {
	t.Helper()
	m := trkModel(t, kvcore.Group{Kind: kvcore.KindMLA, BlockSize: 16}, kvcore.Group{Kind: kvcore.KindMamba, BlockSize: 16})
	m.Parallel.TP = 2
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3), ids(10, 3))))
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 3), ids(10, 3))}))
	if len(eff.Loads) != 1 {
		t.Fatalf("%d loads, want 1", len(eff.Loads))
	}
	return m, tr, eff.Loads[0]
}

// TestLoadWaitsForEveryRank: a TP2 load is finished only when both ranks
// reported, with the union of their load errors; repeats and unknown ranks
// change nothing.
func TestLoadWaitsForEveryRank(t *testing.T) {
	_, tr, task := rankLoad(t)
	if want := []kvcore.Rank{{TP: 0}, {TP: 1}}; !slices.Equal(task.Ranks, want) {
		t.Fatalf("task ranks %v, want %v", task.Ranks, want)
	}
	r0, r1, r7 := kvcore.Rank{TP: 0}, kvcore.Rank{TP: 1}, kvcore.Rank{TP: 7}
	if eff := noErr(t, tr.OnRankLoadResult(task.TaskID, &r0, []kvcore.BlockID{0})); len(eff.Feedback) != 0 {
		t.Fatalf("one rank of two reported: feedback %+v, want none", eff.Feedback)
	}
	for _, r := range []*kvcore.Rank{&r0, &r7, nil} {
		if eff := noErr(t, tr.OnRankLoadResult(task.TaskID, r, []kvcore.BlockID{1})); len(eff.Feedback) != 0 {
			t.Fatalf("report from %v: feedback %+v, want none", r, eff.Feedback)
		}
	}
	eff := noErr(t, tr.OnRankLoadResult(task.TaskID, &r1, []kvcore.BlockID{11, 0}))
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedRecving {
		t.Fatalf("both ranks reported: feedback %+v, want one finished_recving", eff.Feedback)
	}
	if got := eff.Feedback[0].LoadErrors; !slices.Equal(got, []kvcore.BlockID{0, 11}) {
		t.Errorf("load errors %v, want the union [0 11]", got)
	}
	if len(tr.LoadWaits) != 0 || len(tr.PendingLoads) != 0 {
		t.Errorf("waits %v, pending %v left after the last rank", tr.LoadWaits, tr.PendingLoads)
	}
}

// TestExpireLoadsFailsClosed: a rank that never reports makes every block
// of the load a load error, and the feedback names it.
func TestExpireLoadsFailsClosed(t *testing.T) {
	_, tr, task := rankLoad(t)
	r1 := kvcore.Rank{TP: 1}
	noErr(t, tr.OnRankLoadResult(task.TaskID, &r1, nil))
	if eff := tr.ExpireLoads(func(LoadWait) bool { return false }); len(eff.Feedback) != 0 || len(tr.LoadWaits) != 1 {
		t.Fatalf("nothing expired: feedback %+v, waits %d", eff.Feedback, len(tr.LoadWaits))
	}
	eff := noErr(t, tr.ExpireLoads(nil))
	if len(eff.Feedback) != 1 {
		t.Fatalf("expired: feedback %+v, want one finished_recving", eff.Feedback)
	}
	fb := eff.Feedback[0]
	if !slices.Equal(fb.MissingRanks, []kvcore.Rank{{TP: 0}}) {
		t.Errorf("missing ranks %v, want [tp0]", fb.MissingRanks)
	}
	// The load covers chunks 0 and 1 of the MLA group and the Mamba state
	// at 32 (block index 1 of group 1).
	if want := []kvcore.BlockID{0, 1, 11}; !slices.Equal(fb.LoadErrors, want) {
		t.Errorf("load errors %v, want every block of the load %v", fb.LoadErrors, want)
	}
	r0 := kvcore.Rank{TP: 0}
	if late := noErr(t, tr.OnRankLoadResult(task.TaskID, &r0, nil)); len(late.Feedback) != 0 {
		t.Errorf("a late report after expiry yields %+v, want nothing", late.Feedback)
	}
}

// TestStaleRankLoadSettlesSilently: after a preemption a multi-rank load
// is stale; its ranks' reports settle it without feedback.
func TestStaleRankLoadSettlesSilently(t *testing.T) {
	m, tr, task := rankLoad(t)
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted}))
	for _, r := range []kvcore.Rank{{TP: 0}, {TP: 1}} {
		if eff := noErr(t, tr.OnRankLoadResult(task.TaskID, &r, nil)); len(eff.Feedback) != 0 {
			t.Fatalf("stale load report yields %+v", eff.Feedback)
		}
	}
	if len(tr.StaleLoads) != 0 || len(tr.LoadWaits) != 0 {
		t.Errorf("stale %v waits %v left", tr.StaleLoads, tr.LoadWaits)
	}
}
