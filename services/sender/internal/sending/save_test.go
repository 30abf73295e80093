package sending

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// TestSaveOutcome: the task's status ranks failed over dead_lettered over
// skipped over stored; groups stay in group order, a fault counts at least
// one key and a group keeps its first reason.
func TestSaveOutcome(t *testing.T) {
	task := &kvcore.SaveTask{TaskID: "t", EngineID: "e", RequestID: "r"}
	cases := []struct {
		name   string
		record func(s *save)
		want   kvcore.SaveStatus
	}{
		{"nothing to do is stored", func(*save) {}, kvcore.SaveStored},
		{"stored and existed", func(s *save) {
			s.record(0, keysStored, 2, kvcore.ReasonOK)
			s.record(0, keysExisting, 1, kvcore.ReasonOK)
		}, kvcore.SaveStored},
		{"skipped", func(s *save) { s.record(1, keysSkipped, 3, kvcore.ReasonStorePressure) }, kvcore.SaveSkipped},
		{"dead letter beats skip", func(s *save) {
			s.record(0, keysSkipped, 3, kvcore.ReasonStorePressure)
			s.record(1, keysDeadLettered, 0, kvcore.ReasonNullBlock)
		}, kvcore.SaveDeadLettered},
		{"failure beats all", func(s *save) {
			s.record(1, keysDeadLettered, 2, kvcore.ReasonNullBlock)
			s.record(0, keysFailed, 0, kvcore.ReasonPutFailed)
		}, kvcore.SaveFailed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newSave(task, nil, kvcore.KeyBuilder{})
			c.record(s)
			if got := s.status(); got != c.want || s.result().Status != string(c.want) {
				t.Fatalf("status %s, result %s, want %s (%+v)", got, s.result().Status, c.want, s.groups)
			}
		})
	}
	s := newSave(task, nil, kvcore.KeyBuilder{})
	s.record(5, keysStored, 1, kvcore.ReasonOK)
	s.record(1, keysFailed, -3, kvcore.ReasonPutFailed)
	s.record(3, keysExisting, 2, kvcore.ReasonOK)
	s.record(1, keysFailed, 2, kvcore.ReasonExistsFailed)
	want := []contract.GroupOutcome{
		{Group: 1, Failed: 3, Reason: string(kvcore.ReasonPutFailed)},
		{Group: 3, Existing: 2},
		{Group: 5, Stored: 1},
	}
	if got := s.result().Groups; !reflect.DeepEqual(got, want) {
		t.Fatalf("groups %+v, want %+v", got, want)
	}
	if tot := s.totals(); tot != (contract.GroupOutcome{Group: -1, Stored: 1, Existing: 2, Failed: 3, Reason: string(kvcore.ReasonPutFailed)}) {
		t.Fatalf("totals %+v", tot)
	}
	if o := s.outcome(); !reflect.DeepEqual(o.Groups, map[string]int{groupFailed: 1, groupExisting: 1, groupStored: 1}) {
		t.Fatalf("group counts %v", o.Groups)
	}
}

// TestSaveOutcomeScenarios is the sender's account in the tracker
// scenarios S16 (a 1-group table on a 2-group model: group 1 dead-lettered
// before any key was built, still counted, the task dead_lettered) and S17
// (existence check given up for group 0, a put failed in group 1: the task
// failed, each group with its own reason).
func TestSaveOutcomeScenarios(t *testing.T) {
	task := &kvcore.SaveTask{TaskID: "e1/r1/save/1", EngineID: "e1", RequestID: "r1"}
	s16 := newSave(task, nil, kvcore.KeyBuilder{})
	s16.record(0, keysStored, 2, kvcore.ReasonOK)
	s16.deadLetter(1, kvcore.ReasonTableGroupCount, "1 group in the table", 0)
	if g := s16.result().Groups; s16.status() != kvcore.SaveDeadLettered || g[0].Stored != 2 || g[1].DeadLettered != 1 || len(s16.deadLetters) != 1 {
		t.Fatalf("S16 outcome %+v, dead letters %+v", g, s16.deadLetters)
	}
	s17 := newSave(task, nil, kvcore.KeyBuilder{})
	s17.record(0, keysDeadLettered, 2, kvcore.ReasonExistsFailed)
	s17.record(1, keysFailed, 1, kvcore.ReasonPutFailed)
	tot := s17.totals()
	if g := s17.result().Groups; tot.DeadLettered != 2 || tot.Failed != 1 || g[1].Reason != string(kvcore.ReasonPutFailed) || s17.status() != kvcore.SaveFailed {
		t.Fatalf("S17 outcome %+v totals %+v", g, tot)
	}
}

// TestSaveAnswered: one rank's answers are recorded per item (stored, no
// space as skipped, not held dead-lettered per group, any other status
// failed), a rank whose request failed is counted failed and dead-lettered
// with put_failed unless the worker rejected it, and nothing is recorded
// for a failed rank of an interrupted save.
func TestSaveAnswered(t *testing.T) {
	task := &kvcore.SaveTask{TaskID: "t", EngineID: "e", RequestID: "r"}
	it := func(g int, key string, rank int) item {
		return item{TransferItem: kvcore.TransferItem{Group: g, Key: key}, rank: kvcore.Rank{TP: rank}}
	}
	batches := [][]item{
		{it(0, "a", 0), it(0, "b", 0), it(1, "c", 0), it(1, "d", 0)},
		{it(0, "e", 1)},
		{it(1, "f", 2)},
	}
	answers := []rankAnswer{
		{results: []dataplane.PutResult{{Status: dataplane.PutStored}, {Status: dataplane.PutNoSpace}, {Status: dataplane.PutNotHeld, Error: "reused"}, {Status: "bogus"}}, bytes: 64},
		{err: errors.New("worker gone")},
		{err: fmt.Errorf("bad frame: %w", dataplane.ErrRejected)},
	}
	s := newSave(task, nil, kvcore.KeyBuilder{})
	tally := s.answered(batches, answers, false, 3)
	if tally != (putTally{stored: true, noSpace: true}) {
		t.Fatalf("tally %+v", tally)
	}
	want := []contract.GroupOutcome{
		{Group: 0, Stored: 1, Skipped: 1, Failed: 1, Reason: string(kvcore.ReasonStorePressure)},
		{Group: 1, DeadLettered: 1, Failed: 2, Reason: string(kvcore.ReasonPutFailed)},
	}
	if got := s.result().Groups; !reflect.DeepEqual(got, want) {
		t.Fatalf("groups %+v, want %+v", got, want)
	}
	var reasons []string
	for _, d := range s.deadLetters {
		reasons = append(reasons, string(d.Reason))
	}
	if !reflect.DeepEqual(reasons, []string{string(kvcore.ReasonPutFailed), string(kvcore.ReasonBlockNotHeld)}) ||
		!strings.Contains(s.deadLetters[0].Detail, "failed 3 times") || !strings.Contains(s.deadLetters[1].Detail, "reused") {
		t.Fatalf("dead letters %+v", s.deadLetters)
	}
	if s.bytes != 64 || s.skipped != 1 || !reflect.DeepEqual(s.stored, map[int][]string{0: {"a"}}) {
		t.Fatalf("bytes %d skipped %d stored %v", s.bytes, s.skipped, s.stored)
	}
	quiet := newSave(task, nil, kvcore.KeyBuilder{})
	quiet.answered(batches[1:2], answers[1:2], true, 3)
	if len(quiet.groups) != 0 || len(quiet.deadLetters) != 0 {
		t.Fatalf("interrupted save recorded %+v, %+v", quiet.groups, quiet.deadLetters)
	}
}

// TestSaveAnsweredExisting: a key another save stored between this save's
// exists check and its put (PutExisting) counts existing, not stored, and
// is recorded present, not put.
func TestSaveAnsweredExisting(t *testing.T) {
	s := newSave(&kvcore.SaveTask{TaskID: "t", EngineID: "e", RequestID: "r"}, nil, kvcore.KeyBuilder{})
	batch := []item{{TransferItem: kvcore.TransferItem{Group: 0, Key: "a"}}, {TransferItem: kvcore.TransferItem{Group: 0, Key: "b"}}}
	tally := s.answered([][]item{batch}, []rankAnswer{{results: []dataplane.PutResult{{Status: dataplane.PutStored}, {Status: dataplane.PutExisting}}, bytes: 32}}, false, 1)
	if tally != (putTally{stored: true}) {
		t.Fatalf("tally %+v", tally)
	}
	want := []contract.GroupOutcome{{Group: 0, Stored: 1, Existing: 1}}
	if got := s.result().Groups; !reflect.DeepEqual(got, want) {
		t.Fatalf("groups %+v, want %+v", got, want)
	}
	if !reflect.DeepEqual(s.stored, map[int][]string{0: {"a"}}) || !reflect.DeepEqual(s.present, map[int][]string{0: {"b"}}) {
		t.Fatalf("put %v, present %v; want a put and b present", s.stored, s.present)
	}
}

// TestSaveScenarioPressureScoped (S66): store pressure is scoped to the
// request whose put got "no space" (worker.py
// _mark_request_skipped_for_pressure, _should_skip_request,
// _clear_store_pressure), and the skipped range reaches the tracker through
// the save result: request a's first save gets "no space", its second is
// skipped by the gate, request b's is put and stored, which lets a go; a's
// third save covers [0,64), the two skipped ranges included.
func TestSaveScenarioPressureScoped(t *testing.T) {
	m := &kvcore.Model{Name: "test-model", HashBlockSize: 16,
		Groups: []kvcore.Group{{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 1024}}}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	g := sendpolicy.PressureGate{ProbeEvery: 8, CoolDown: time.Hour}
	now := time.Unix(2000, 0)
	hashes := make([]string, 8)
	for i := range hashes {
		hashes[i] = fmt.Sprintf("%064x", i+1)
	}
	a, b := requeststate.NewTracker(m, "e1", "a"), requeststate.NewTracker(m, "e1", "b")
	for _, tr := range []*requeststate.Tracker{a, b} {
		tr.OnAdmit(hashes, 0)
	}
	table := func(first, n int) kvcore.BlockTable {
		ids := make([]kvcore.BlockID, n)
		for i := range ids {
			ids[i] = kvcore.BlockID(first + i)
		}
		return kvcore.BlockTable{ids}
	}
	// send plays the sender for one task: the gate's admission, then the
	// store's answer for every key when the task is put; the report is the
	// scheduler's reading of the result (status, skipped and failed keys).
	send := func(task *kvcore.SaveTask, noSpace bool) (sendpolicy.Admission, kvcore.SaveReport) {
		adm := g.Admit(sendpolicy.PressureScopeOf(task), now)
		s := newSave(task, nil, kvcore.KeyBuilder{})
		keys := len(task.Groups[0].Chunks)
		switch {
		case adm == sendpolicy.AdmitSkip:
			s.record(0, keysSkipped, keys, kvcore.ReasonStorePressure)
		case noSpace:
			s.record(0, keysSkipped, keys, kvcore.ReasonStorePressure)
			g.OnNoSpace(sendpolicy.PressureScopeOf(task), now)
		default:
			s.record(0, keysStored, keys, kvcore.ReasonOK)
			g.OnPutOK()
		}
		tot := s.totals()
		return adm, kvcore.SaveReport{Status: s.status(), Skipped: tot.Skipped, Failed: tot.Failed}
	}
	type span struct{ start, end, epoch int }
	steps := []struct {
		tr       *requeststate.Tracker
		step     kvcore.Step
		noSpace  bool
		want     span
		admitted sendpolicy.Admission
		status   kvcore.SaveStatus
	}{
		{a, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 4)}, true, span{0, 32, 0}, sendpolicy.AdmitPut, kvcore.SaveSkipped},
		{a, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, false, span{0, 48, 0}, sendpolicy.AdmitSkip, kvcore.SaveSkipped},
		{b, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(10, 2)}, false, span{0, 32, 0}, sendpolicy.AdmitPut, kvcore.SaveStored},
		{a, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64}, false, span{0, 64, 0}, sendpolicy.AdmitPut, kvcore.SaveStored},
	}
	for i, st := range steps {
		eff := st.tr.Step(m, st.step)
		if eff.Err != nil || len(eff.Saves) != 1 || (span{eff.Saves[0].Start, eff.Saves[0].End, eff.Saves[0].Epoch}) != st.want {
			t.Fatalf("step %d: saves %+v (%v), want %v", i, eff.Saves, eff.Err, st.want)
		}
		adm, rep := send(&eff.Saves[0], st.noSpace)
		if adm != st.admitted || rep.Status != st.status {
			t.Fatalf("step %d: admitted %s, status %s; want %s, %s", i, adm, rep.Status, st.admitted, st.status)
		}
		if eff := st.tr.OnSaveReport(m, eff.Saves[0].TaskID, rep); eff.Err != nil {
			t.Fatalf("step %d: report: %v", i, eff.Err)
		}
	}
	if g.Skipped != 1 || g.Active() || g.Episodes != 1 || a.Reports != (kvcore.SaveCounts{Stored: 1, Skipped: 2}) || len(a.Unsaved) != 0 {
		t.Fatalf("gate %+v, a's reports %+v unsaved %v", g, a.Reports, a.Unsaved)
	}
	// A stale task of a's (epoch 0) under pressure does not sentence a's
	// resumed saves (epoch 1).
	g.OnNoSpace(sendpolicy.PressureScopeOf(&kvcore.SaveTask{EngineID: "e1", RequestID: "a"}), now)
	if adm := g.Admit(sendpolicy.PressureScopeOf(&kvcore.SaveTask{EngineID: "e1", RequestID: "a", Epoch: 1}), now); adm != sendpolicy.AdmitPut {
		t.Fatalf("epoch-1 save of a under epoch-0 pressure: %s, want put", adm)
	}
}
