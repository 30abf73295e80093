package requeststate

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// trkModel builds a model named test-model (hash block 16) from groups.
func trkModel(t testing.TB, groups ...kvcore.Group) *kvcore.Model {
	t.Helper()
	m := &kvcore.Model{Name: "test-model", HashBlockSize: 16}
	for _, g := range groups {
		g.BytesPerBlock = 1024
		m.Groups = append(m.Groups, g)
	}
	if err := m.Validate(); err != nil {
		t.Fatalf("test model: %v", err)
	}
	return m
}

// trkDense is one full-attention group of block size 16.
func trkDense(t testing.TB) *kvcore.Model {
	return trkModel(t, kvcore.Group{Kind: kvcore.KindFullAttention, BlockSize: 16})
}

// trkHybrid is full attention plus Mamba state, both block size 16.
func trkHybrid(t testing.TB) *kvcore.Model {
	return trkModel(t, kvcore.Group{Kind: kvcore.KindFullAttention, BlockSize: 16}, kvcore.Group{Kind: kvcore.KindMamba, BlockSize: 16})
}

// trkHashes is a hash chain of n distinct lower-case hex hashes.
func trkHashes(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%064x", i+1)
	}
	return out
}

// tbl builds a block table from per-group lists.
func tbl(groups ...[]kvcore.BlockID) kvcore.BlockTable { return kvcore.BlockTable(groups) }

// ids lists n block ids from first.
func ids(first, n int) []kvcore.BlockID {
	out := make([]kvcore.BlockID, n)
	for i := range out {
		out[i] = kvcore.BlockID(first + i)
	}
	return out
}

// newTrk is a tracker of model m with a 64-block hash chain admitted.
func newTrk(m *kvcore.Model) *Tracker {
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(trkHashes(64), 0)
	return tr
}

// noErr fails on an effect error.
func noErr(t *testing.T, eff Effects) Effects {
	t.Helper()
	if eff.Err != nil {
		t.Fatalf("unexpected error: %v", eff.Err)
	}
	return eff
}

// isErr fails unless the effect error wraps want.
func isErr(t *testing.T, eff Effects, want error) Effects {
	t.Helper()
	if !errors.Is(eff.Err, want) {
		t.Fatalf("error %v, want %v", eff.Err, want)
	}
	return eff
}

// counts returns the number of saves, loads and feedback messages.
func effCounts(eff Effects) [3]int { return [3]int{len(eff.Saves), len(eff.Loads), len(eff.Feedback)} }

func TestTrackerNewSavesAlignedRange(t *testing.T) {
	m := trkModel(t, kvcore.Group{Kind: kvcore.KindFullAttention, BlockSize: 32}, kvcore.Group{Kind: kvcore.KindSlidingWindow, BlockSize: 16, Window: 32})
	tr := newTrk(m)
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 100, Table: tbl(ids(0, 4), ids(10, 7))}))
	if len(eff.Saves) != 1 {
		t.Fatalf("saves = %d, want 1", len(eff.Saves))
	}
	s := eff.Saves[0]
	if s.Start != 0 || s.End != 96 || s.Schema != kvcore.SchemaSaveTask || s.Model != "test-model" {
		t.Fatalf("save = %+v", s)
	}
	if s.TaskID != "e1/r1/save/1" || len(s.BlockHashes) != 6 {
		t.Fatalf("task id %q, %d hashes", s.TaskID, len(s.BlockHashes))
	}
	if !reflect.DeepEqual(s.Groups, m.SaveGroups(0, 96)) {
		t.Fatalf("groups = %+v", s.Groups)
	}
	if tr.NumSavedTokens != 96 || !reflect.DeepEqual(tr.PendingSaves, []string{s.TaskID}) {
		t.Fatalf("saved %d, pending %v", tr.NumSavedTokens, tr.PendingSaves)
	}
	for _, v := range kvcore.ValidateSave(m, nil, &s) {
		if !v.OK() {
			t.Fatalf("emitted save invalid: %+v", v)
		}
	}
}

func TestTrackerSaveSnapshotDoesNotAlias(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	in := tbl(ids(0, 2))
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: in}))
	in[0][0] = 99
	tr.Table[0][1] = 98
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: tbl(ids(2, 1))}))
	if got := eff.Saves[0].BlockTable; !reflect.DeepEqual(got, tbl(ids(0, 2))) {
		t.Fatalf("snapshot changed to %v", got)
	}
}

func TestTrackerGroupCountMismatchErrors(t *testing.T) {
	m := trkHybrid(t)
	cases := []struct {
		name  string
		steps []kvcore.Step
	}{
		{"new with one group", []kvcore.Step{{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))}}},
		{"new with empty table", []kvcore.Step{{Kind: kvcore.StepNew, Tokens: 32, Table: kvcore.BlockTable{}}}},
		{"resumed with three groups", []kvcore.Step{{Kind: kvcore.StepResumed, Tokens: 32, Table: tbl(ids(0, 2), ids(2, 2), ids(4, 2))}}},
		{"running appends one group", []kvcore.Step{
			{Kind: kvcore.StepNew, Tokens: 16, Table: tbl(ids(0, 1), ids(5, 1))},
			{Kind: kvcore.StepRunning, Tokens: 32, Table: tbl(ids(1, 1))},
		}},
		{"decode appends empty table", []kvcore.Step{
			{Kind: kvcore.StepNew, Tokens: 16, Table: tbl(ids(0, 1), ids(5, 1))},
			{Kind: kvcore.StepDecode, Tokens: 17, Table: kvcore.BlockTable{}},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr := newTrk(m)
			var eff Effects
			for _, s := range c.steps {
				eff = tr.Step(m, s)
			}
			isErr(t, eff, kvcore.ErrGroupCount)
			if tr.State != StateErrored || !strings.Contains(tr.Error, "group") {
				t.Fatalf("state %s error %q", tr.State, tr.Error)
			}
			saved := tr.NumSavedTokens
			eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(8, 2), ids(9, 2))})
			if effCounts(eff) != [3]int{} || eff.Err != nil || tr.NumSavedTokens != saved {
				t.Fatalf("errored request acted: %+v", eff)
			}
		})
	}
}

func TestTrackerErroredFinish(t *testing.T) {
	m := trkHybrid(t)
	t.Run("nothing outstanding frees now", func(t *testing.T) {
		tr := newTrk(m)
		tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))})
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
		if len(eff.Feedback) != 1 || !eff.Feedback[0].Immediate || !eff.Drop {
			t.Fatalf("finish effects %+v", eff)
		}
	})
	t.Run("outstanding save delays the free", func(t *testing.T) {
		tr := newTrk(m)
		save := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2), ids(4, 2))})).Saves[0]
		isErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: tbl(ids(2, 1))}), kvcore.ErrGroupCount)
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
		if effCounts(eff) != [3]int{} || tr.State != StateFinishing {
			t.Fatalf("finish effects %+v state %s", eff, tr.State)
		}
		eff = noErr(t, tr.OnSaveResult(save.TaskID, kvcore.SaveStored))
		if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedSending || eff.Feedback[0].Immediate || !eff.Drop {
			t.Fatalf("result effects %+v", eff)
		}
	})
}

func TestTrackerAllocation(t *testing.T) {
	m := trkDense(t)
	spec := &kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 48}
	cases := []struct {
		name      string
		lookFirst bool
		spec      *kvcore.LoadSpec
		external  int
		canLoad   bool
		err       error
		recvErrs  []kvcore.BlockID // finished_recving with these blocks, nil: none
	}{
		{"accepted", true, spec, 32, true, nil, nil},
		{"accepted, lookup arrives late", false, spec, 32, true, nil, nil},
		{"rejected", true, spec, 0, false, nil, nil},
		{"rejected, lookup arrives late", false, spec, 0, false, nil, nil},
		{"count mismatch", true, spec, 16, false, kvcore.ErrExternalTokens, ids(0, 3)},
		{"external without spec", true, nil, 32, false, kvcore.ErrExternalTokens, ids(0, 3)},
		{"negative", true, spec, -1, false, kvcore.ErrNegativeCount, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr := newTrk(m)
			var eff Effects
			if c.lookFirst {
				noErr(t, tr.OnLookup(m, c.spec))
				eff = tr.OnAllocate(m, c.external, tbl(ids(0, 3)))
			} else {
				noErr(t, tr.OnAllocate(m, c.external, tbl(ids(0, 3))))
				eff = tr.OnLookup(m, c.spec)
			}
			if c.err != nil {
				isErr(t, eff, c.err)
			} else {
				noErr(t, eff)
			}
			if got := tr.Load.Spec != nil && tr.Load.Spec.CanLoad; got != c.canLoad {
				t.Fatalf("can_load = %v, want %v", got, c.canLoad)
			}
			if c.recvErrs != nil {
				if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedRecving || !reflect.DeepEqual(eff.Feedback[0].LoadErrors, c.recvErrs) {
					t.Fatalf("feedback %+v", eff.Feedback)
				}
			} else if len(eff.Feedback) != 0 {
				t.Fatalf("unexpected feedback %+v", eff.Feedback)
			}
			if tr.State == StateErrored {
				t.Fatalf("allocation mismatch must not stop the request: %s", tr.Error)
			}
		})
	}
}

func TestTrackerAllocateTwice(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 0, nil))
	isErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 2))), kvcore.ErrAllocatedTwice)
	if tr.Load.Spec.CanLoad {
		t.Fatal("a rejected spec became loadable without a new lookup")
	}
	// A new lookup starts a new attempt, which may accept.
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 2))))
	if !tr.Load.Spec.CanLoad {
		t.Fatal("new attempt not accepted")
	}
}

func TestTrackerAllocationTableGroupCount(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	eff := isErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 2))), kvcore.ErrGroupCount)
	if tr.State != StateErrored {
		t.Fatalf("state %s", tr.State)
	}
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedRecving || !reflect.DeepEqual(eff.Feedback[0].LoadErrors, ids(0, 2)) {
		t.Fatalf("feedback %+v, want finished_recving with every block in error", eff.Feedback)
	}
	if eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad}); effCounts(eff) != [3]int{} {
		t.Fatalf("errored request emitted %+v", eff)
	}
}

func TestTrackerLateLookupIssuesLoad(t *testing.T) {
	m := trkDense(t)
	t.Run("pending", func(t *testing.T) {
		tr := newTrk(m)
		noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3))))
		if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})); effCounts(eff) != [3]int{} {
			t.Fatalf("unresolved pending emitted %+v", eff)
		}
		eff := noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		if len(eff.Loads) != 1 || !reflect.DeepEqual(eff.Loads[0].BlockTable, tbl(ids(0, 3))) {
			t.Fatalf("late lookup effects %+v", eff)
		}
	})
	t.Run("scheduled", func(t *testing.T) {
		tr := newTrk(m)
		noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3))))
		if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 3))})); effCounts(eff) != [3]int{} {
			t.Fatalf("a save before the expected load: %+v", eff)
		}
		eff := noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		if len(eff.Loads) != 1 || len(eff.Saves) != 0 || tr.NumSavedTokens != 0 {
			t.Fatalf("late lookup effects %+v", eff)
		}
	})
}

func TestTrackerNoSaveWhileLoadOutstanding(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3))))
	load := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 3))})).Loads[0]
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(3, 1))})); len(eff.Saves) != 0 {
		t.Fatalf("saved while the load is outstanding: %+v", eff.Saves)
	}
	eff := noErr(t, tr.OnLoadResult(load.TaskID, []kvcore.BlockID{1}))
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedRecving || !reflect.DeepEqual(eff.Feedback[0].LoadErrors, []kvcore.BlockID{1}) {
		t.Fatalf("load result effects %+v", eff)
	}
	if eff := noErr(t, tr.OnLoadResult(load.TaskID, nil)); effCounts(eff) != [3]int{} {
		t.Fatalf("repeated load result acted: %+v", eff)
	}
	eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 65}))
	if len(eff.Saves) != 1 || eff.Saves[0].Start != 0 || eff.Saves[0].End != 64 {
		t.Fatalf("save after the load: %+v", eff.Saves)
	}
}

func TestTrackerPrefillEndCapsSaves(t *testing.T) {
	m := trkDense(t)
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(trkHashes(8), 40)
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: tbl(ids(0, 3))}))
	if len(eff.Saves) != 1 || eff.Saves[0].End != 32 {
		t.Fatalf("prefill save %+v", eff.Saves)
	}
	if eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(3, 1))})); len(eff.Saves) != 0 {
		t.Fatalf("decode tokens saved: %+v", eff.Saves)
	}
}

func TestTrackerShortHashChainHoldsSave(t *testing.T) {
	m := trkDense(t)
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(trkHashes(2), 0)
	eff := isErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: tbl(ids(0, 4))}), kvcore.ErrShortHashChain)
	if len(eff.Saves) != 1 || eff.Saves[0].End != 32 || tr.State != StateRunning {
		t.Fatalf("saves %+v state %s", eff.Saves, tr.State)
	}
	eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Hashes: trkHashes(4)}))
	if len(eff.Saves) != 1 || eff.Saves[0].Start != 32 || eff.Saves[0].End != 64 {
		t.Fatalf("saves after hashes arrived %+v", eff.Saves)
	}
}

func TestTrackerTableCoverageCapsSave(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: tbl(ids(0, 4), ids(10, 2))}))
	if len(eff.Saves) != 1 || eff.Saves[0].End != 32 {
		t.Fatalf("saves %+v, want one ending at 32", eff.Saves)
	}
}

func TestTrackerStepErrors(t *testing.T) {
	m := trkDense(t)
	cases := []struct {
		name    string
		prepare []kvcore.Step
		step    kvcore.Step
		want    error
		errored bool
	}{
		{"running before scheduled", nil, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 16}, kvcore.ErrBadStep, true},
		{"pending while running", []kvcore.Step{{Kind: kvcore.StepNew, Tokens: 8, Table: tbl(ids(0, 1))}}, kvcore.Step{Kind: kvcore.StepPendingLoad}, kvcore.ErrBadStep, false},
		{"unknown kind", nil, kvcore.Step{Kind: "bogus"}, kvcore.ErrUnknownStep, false},
		{"negative tokens", nil, kvcore.Step{Kind: kvcore.StepNew, Tokens: -1, Table: tbl(ids(0, 1))}, kvcore.ErrNegativeCount, true},
		{"step after finish", []kvcore.Step{{Kind: kvcore.StepFinished}}, kvcore.Step{Kind: kvcore.StepNew, Tokens: 16, Table: tbl(ids(0, 1))}, kvcore.ErrRequestFinished, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr := newTrk(m)
			for _, s := range c.prepare {
				noErr(t, tr.Step(m, s))
			}
			isErr(t, tr.Step(m, c.step), c.want)
			if (tr.State == StateErrored) != c.errored {
				t.Fatalf("state %s", tr.State)
			}
		})
	}
}

func TestTrackerRefusesOtherModel(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	other := trkDense(t)
	other.Name = "other"
	isErr(t, tr.Step(other, kvcore.Step{Kind: kvcore.StepNew, Tokens: 16, Table: tbl(ids(0, 1))}), kvcore.ErrUnknownModel)
	isErr(t, tr.OnLookup(nil, nil), kvcore.ErrUnknownModel)
	if tr.State != StateWaiting {
		t.Fatalf("state %s", tr.State)
	}
}

func TestTrackerConsumerNeverSaves(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	tr.Consumer = true
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: tbl(ids(0, 4))})); len(eff.Saves) != 0 {
		t.Fatalf("consumer saved %+v", eff.Saves)
	}
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if len(eff.Feedback) != 1 || !eff.Feedback[0].Immediate {
		t.Fatalf("consumer finish %+v", eff)
	}
}

func TestTrackerSaveResults(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	a := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))})).Saves[0]
	b := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: tbl(ids(2, 1))})).Saves[0]
	if a.TaskID == b.TaskID || b.Start != 32 {
		t.Fatalf("tasks %q %q start %d", a.TaskID, b.TaskID, b.Start)
	}
	isErr(t, tr.OnSaveResult(a.TaskID, "maybe"), kvcore.ErrUnknownSaveStatus)
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if eff := noErr(t, tr.OnSaveResult(a.TaskID, kvcore.SaveDeadLettered)); effCounts(eff) != [3]int{} || eff.Drop {
		t.Fatalf("first of two results %+v", eff)
	}
	if eff := noErr(t, tr.OnSaveResult(a.TaskID, kvcore.SaveStored)); effCounts(eff) != [3]int{} {
		t.Fatalf("repeated result acted: %+v", eff)
	}
	eff := noErr(t, tr.OnSaveResult(b.TaskID, kvcore.SaveSkipped))
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedSending || !eff.Drop {
		t.Fatalf("last result %+v", eff)
	}
	if want := (kvcore.SaveCounts{Skipped: 1, DeadLettered: 1}); tr.Reports != want {
		t.Fatalf("reports %+v, want %+v", tr.Reports, want)
	}
}

func TestTrackerDropWaitsForLoad(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 2))))
	load := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})).Loads[0]
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if len(eff.Feedback) != 1 || eff.Drop {
		t.Fatalf("finish with a load outstanding %+v", eff)
	}
	eff = noErr(t, tr.OnLoadResult(load.TaskID, nil))
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedRecving || !eff.Drop {
		t.Fatalf("load result %+v", eff)
	}
}

func TestTrackerJSONRoundTrip(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	tr.Connector = "store"
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{VLLMCachedTokens: 0, KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3), []kvcore.BlockID{kvcore.NullBlock, kvcore.NullBlock, 9})))
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad}))
	tr.PendingSaves = []string{"e1/r1/save/9"}
	tr.Reports.Failed = 2
	b, err := MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalTracker(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(tr, back) {
		t.Fatalf("round trip changed the tracker:\n%+v\n%+v", tr, back)
	}
	// The restored tracker behaves the same: the load is not issued twice.
	if eff := noErr(t, back.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})); len(eff.Loads) != 0 {
		t.Fatalf("restored tracker re-issued the load")
	}
	if _, err := UnmarshalTracker([]byte(`{"state":`)); err == nil {
		t.Fatal("bad JSON decoded")
	}
}
