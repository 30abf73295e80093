package requeststate

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// rankHarness starts a request of the hybrid preset at TP2 with one
// accepted 32-token load from connector (store or pd) into table(0, 3),
// and returns the harness and the load task.
func rankHarness(t *testing.T, connector string) (*harness, kvcore.LoadTask) {
	t.Helper()
	h := newHarness(t)
	h.m.Parallel.TP = 2
	pdTokens := 0
	if connector == ConnectorPD {
		pdTokens = 32
	}
	h.r.Decision(h.m, decision("d1", connector, 32, pdTokens))
	h.alloc(32, table(0, 3), "d1")
	o := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	want(t, o, [3]int{0, 1, 0}, "pending load")
	l := o.Loads[0]
	if l.Connector != connector || !slices.Equal(l.Ranks, []kvcore.Rank{{TP: 0}, {TP: 1}}) {
		t.Fatalf("load %+v, want a %s load for ranks tp0 and tp1", l, connector)
	}
	return h, l
}

// rankResult is a load result of task from rank (nil: none).
func rankResult(task kvcore.LoadTask, rank *kvcore.Rank, errs ...kvcore.BlockID) contract.TransferResult {
	return contract.TransferResult{ResultID: "x", Kind: contract.TransferLoad, TaskID: task.TaskID, Status: "done", Rank: rank, LoadErrors: errs}
}

// TestRankLoadResults: a TP2 load is finished by its second rank's
// result, with the union of both ranks' load errors; a repeat, an unknown
// rank and a result without a rank change nothing; the task stays
// outstanding until the last rank reported.
func TestRankLoadResults(t *testing.T) {
	for _, connector := range []string{ConnectorStore, ConnectorPD} {
		t.Run(connector, func(t *testing.T) {
			h, l := rankHarness(t, connector)
			r0, r1, r7 := kvcore.Rank{TP: 0}, kvcore.Rank{TP: 1}, kvcore.Rank{TP: 7}
			o := h.r.Result(h.m, rankResult(l, &r0, 0))
			if counts(o) != [3]int{} || o.Ignored != "" || len(h.r.Tasks) != 1 {
				t.Fatalf("rank 0 of 2: %+v, outstanding %+v; want no feedback, the task outstanding", o, h.r.Tasks)
			}
			for _, tc := range []struct {
				rank *kvcore.Rank
				why  string
			}{{&r0, IgnoredRepeatRank}, {&r7, IgnoredUnknownRank}, {nil, IgnoredUnknownRank}} {
				if o := h.r.Result(h.m, rankResult(l, tc.rank, 1)); counts(o) != [3]int{} || o.Ignored != tc.why {
					t.Fatalf("result from %s: %+v, want ignored %q", rankName(tc.rank), o, tc.why)
				}
			}
			if n := len(h.r.Warnings); n != 2 || !strings.Contains(h.r.Warnings[0].Error, ErrUnknownRank.Error()) {
				t.Fatalf("warnings %+v, want one per unknown rank", h.r.Warnings)
			}
			o = h.r.Result(h.m, rankResult(l, &r1, 101, 0))
			want(t, o, [3]int{0, 0, 1}, "last rank")
			if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedRecving || !slices.Equal(f.LoadErrors, []kvcore.BlockID{0, 101}) || len(f.MissingRanks) != 0 {
				t.Fatalf("feedback %+v, want finished_recving with load errors [0 101]", f)
			}
			if len(h.r.Tasks) != 0 {
				t.Fatalf("outstanding %+v after the last rank", h.r.Tasks)
			}
			if o := h.r.Result(h.m, rankResult(l, &r1)); o.Ignored != "unknown_task" {
				t.Fatalf("repeat after the finish: %+v, want unknown_task", o)
			}
		})
	}
}

// TestExpireLoads: a load whose rank 1 never reports is finished at its
// deadline with every block in error and rank 1 missing, once; a late
// result changes nothing.
func TestExpireLoads(t *testing.T) {
	for _, connector := range []string{ConnectorStore, ConnectorPD} {
		t.Run(connector, func(t *testing.T) {
			h, l := rankHarness(t, connector)
			deadline := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
			if got, ok := h.r.StampLoadDeadlines(deadline); !ok || !got.Equal(deadline) {
				t.Fatalf("stamped %v %v, want %v", got, ok, deadline)
			}
			if got, _ := h.r.StampLoadDeadlines(deadline.Add(time.Hour)); !got.Equal(deadline) {
				t.Fatalf("a second stamp moved the deadline to %v", got)
			}
			r0, r1 := kvcore.Rank{TP: 0}, kvcore.Rank{TP: 1}
			h.r.Result(h.m, rankResult(l, &r0, 0))
			before := deadline.Add(-time.Microsecond)
			if ids := h.r.OverdueLoads(before); len(ids) != 0 {
				t.Fatalf("overdue before the deadline: %v", ids)
			}
			if o := h.r.ExpireLoads(before, []string{l.TaskID}); counts(o) != [3]int{} || len(o.Expired) != 0 {
				t.Fatalf("expiry before the deadline: %+v", o)
			}
			ids := h.r.OverdueLoads(deadline)
			if !slices.Equal(ids, []string{l.TaskID}) {
				t.Fatalf("overdue at the deadline: %v, want [%s]", ids, l.TaskID)
			}
			if o := h.r.ExpireLoads(deadline, []string{"other"}); counts(o) != [3]int{} {
				t.Fatalf("expiry of another task: %+v", o)
			}
			o := h.r.ExpireLoads(deadline, ids)
			want(t, o, [3]int{0, 0, 1}, "expiry")
			f := o.Feedback[0]
			if f.Kind != kvcore.FeedbackFinishedRecving || !slices.Equal(f.LoadErrors, []kvcore.BlockID{0, 1, 101}) ||
				!slices.Equal(f.MissingRanks, []kvcore.Rank{r1}) || f.TaskID != l.TaskID {
				t.Fatalf("feedback %+v, want every block [0 1 101] in error and rank 1 missing", f)
			}
			if len(o.Expired) != 1 || o.Expired[0].Connector != connector || !slices.Equal(o.Expired[0].Missing, []kvcore.Rank{r1}) {
				t.Fatalf("expired %+v", o.Expired)
			}
			if len(h.r.Tasks) != 0 || !errors.Is(o.Errors[0], ErrLoadRanksMissing) {
				t.Fatalf("outstanding %+v, errors %v", h.r.Tasks, o.Errors)
			}
			if o := h.r.ExpireLoads(deadline, ids); counts(o) != [3]int{} || len(o.Expired) != 0 {
				t.Fatalf("second expiry: %+v, want nothing", o)
			}
			if o := h.r.Result(h.m, rankResult(l, &r1)); counts(o) != [3]int{} || o.Ignored != "unknown_task" {
				t.Fatalf("late result: %+v, want unknown_task", o)
			}
			if _, ok := h.r.StampLoadDeadlines(deadline); ok {
				t.Fatal("a wait is left after the expiry")
			}
		})
	}
}
