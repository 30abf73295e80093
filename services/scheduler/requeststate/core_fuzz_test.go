package requeststate

import (
	"encoding/json"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// mutateTask applies the fuzzer's mutations to a valid task.
func mutateTask(task *kvcore.SaveTask, tableDelta int8, blockAt uint16, blockVal, startDelta, endDelta int64, hashCut, entryGroup int16) {
	n := max(len(task.BlockTable)+int(tableDelta)%3, 0)
	for len(task.BlockTable) < n {
		task.BlockTable = append(task.BlockTable, ids(0, int(blockAt%6)))
	}
	task.BlockTable = task.BlockTable[:n]
	if n > 0 {
		g := task.BlockTable[int(blockAt)%n]
		if len(g) > 0 {
			g[int(blockAt/8)%len(g)] = kvcore.BlockID(blockVal)
		}
	}
	task.Start += int(startDelta)
	task.End += int(endDelta)
	if h := len(task.BlockHashes); hashCut > 0 && h > 0 {
		task.BlockHashes = task.BlockHashes[:h-int(hashCut)%(h+1)]
	} else if hashCut < 0 && h > 0 {
		task.BlockHashes[(-int(hashCut))%h] = "Zz"
	}
	switch {
	case entryGroup == 0:
	case entryGroup%2 == 0:
		task.Groups = append(task.Groups, kvcore.GroupChunks{Group: int(entryGroup / 2)})
	case len(task.Groups) > 0:
		task.Groups[0].Group = int(entryGroup / 2)
	}
}

// trackerHarness drives one tracker and checks its invariants after every event.
type trackerHarness struct {
	t        *testing.T
	m        *kvcore.Model
	tr       *Tracker
	saves    []string
	loads    []string
	ids      map[string]bool
	rejected bool
	sending  int
	// emitted are the saves in emission order; index maps a save's id to
	// its place there.
	emitted []fuzzSave
	index   map[string]int
	// report is the save report the current event delivered (nil: the
	// event was no save report).
	report *fuzzReport
}

func FuzzTracker(f *testing.F) {
	for preset, m := range fuzzPresets(f) {
		g := len(m.Groups)
		// accepted pending load, load result, new, running, finish, results
		f.Add(newTrackerSeed(preset, g).lookup(0, 2).allocate(true, 4).op(6, 6, 10, 0, 7).
			step(2, 64, 4).step(3, 32, 1).op(8, 9, 0, 0, 9, 1, 0).b)
		// rejected pending load with a 0-group table, then finish (scenario 9)
		f.Add(append(newTrackerSeed(preset, g).lookup(0, 2).b, 1, 0, 1, 6, 6, 8))
		// new with can_load (scenario 7), running while loading, preempt, resume
		f.Add(newTrackerSeed(preset, g).lookup(0, 2).allocate(true, 4).step(2, 48, 4).
			step(3, 16, 1).op(10, 0, 7).lookup(0, 0).allocate(false, 6).step(4, 96, 6).op(8, 9, 0, 1).b)
		// running past the prompt, decode, a second save, finish mid-save (scenario 20)
		f.Add(newTrackerSeed(preset, g).step(2, 40, 3).step(5, 8, 1).step(3, 30, 2).op(8, 9, 1, 0, 9, 0, 2).b)
	}
	rng := rand.New(rand.NewPCG(54643, 1))
	for range 24 {
		b := make([]byte, 96)
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		f.Add(b)
	}
	models := fuzzPresets(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &fuzzEvents{b: data}
		m := models[int(r.byte())%len(models)]
		h := &trackerHarness{t: t, m: m, tr: NewTracker(m, "e", "r"), ids: map[string]bool{}, index: map[string]int{}}
		h.tr.OnAdmit(trkHashes(r.upTo(12)), 0)
		for steps := 0; r.more() && steps < 200; steps++ {
			h.event(r)
		}
	})
}

// event applies one event read from r and checks the invariants.
func (h *trackerHarness) event(r *fuzzEvents) {
	tr, m := h.tr, h.m
	savedBefore, rejectedBefore, epochBefore := tr.NumSavedTokens, h.rejected, tr.Epoch
	h.report = nil
	var eff Effects
	switch op := r.byte() % 14; op {
	case 0:
		var spec *kvcore.LoadSpec
		if r.byte()%4 != 0 {
			cached := r.upTo(4) * 16
			spec = &kvcore.LoadSpec{VLLMCachedTokens: cached, KVPoolCachedTokens: cached + r.upTo(6)*16 - r.upTo(1)*8}
		}
		eff = tr.OnLookup(m, spec)
	case 1:
		external := 0
		switch r.byte() % 3 {
		case 1:
			if s := tr.Load.Spec; s != nil {
				external = s.KVPoolCachedTokens - s.VLLMCachedTokens
			}
		case 2:
			external = r.upTo(80) - 8
		}
		eff = tr.OnAllocate(m, external, r.table(len(m.Groups)))
	case 2, 3, 4, 5:
		kinds := []kvcore.StepKind{kvcore.StepNew, kvcore.StepRunning, kvcore.StepResumed, kvcore.StepDecode}
		tokens := r.upTo(160)
		if op == 3 || op == 5 {
			tokens = tr.TokenLen + r.upTo(40)
		}
		eff = tr.Step(m, kvcore.Step{Kind: kinds[op-2], Tokens: tokens, Table: r.table(len(m.Groups))})
	case 6:
		eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})
	case 7:
		eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted})
	case 8:
		eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished})
	case 9:
		statuses := []kvcore.SaveStatus{kvcore.SaveStored, kvcore.SaveSkipped, kvcore.SaveDeadLettered, kvcore.SaveFailed, "bogus"}
		id, mode := pick(h.saves, r), r.byte()
		rep := kvcore.SaveReport{Status: statuses[r.byte()%5]}
		if mode%4 != 0 {
			rep.Skipped, rep.Failed, rep.ExistsFailed = int(mode>>2)%2, int(mode>>3)%2, int(mode>>4)%2
		}
		running := tr.State == StateRunning || tr.State == StateFinishing
		h.report = &fuzzReport{id: id, rep: rep, model: mode%4 != 0, current: running && slices.Contains(tr.PendingSaves, id)}
		if h.report.model {
			eff = tr.OnSaveReport(m, id, rep)
		} else {
			eff = tr.OnSaveResult(id, rep.Status)
		}
	case 10:
		eff = tr.OnLoadResult(pick(h.loads, r), []kvcore.BlockID{kvcore.BlockID(r.byte())})
	case 11:
		tr.OnAdmit(trkHashes(len(tr.Hashes)+r.upTo(8)), 0)
	case 13:
		eff = tr.FailClosed(kvcore.ErrBadStep) // as for a sequence gap the caller found
	default:
		eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepKind("x")})
	}
	if tr.Epoch < epochBefore || (tr.NumSavedTokens < savedBefore && tr.Epoch == epochBefore) {
		h.t.Fatalf("saved offset %d -> %d, epoch %d -> %d: the offset goes back only when the epoch advances",
			savedBefore, tr.NumSavedTokens, epochBefore, tr.Epoch)
	}
	h.check(eff, rejectedBefore)
}

// check asserts the tracker invariants for one event's effects.
func (h *trackerHarness) check(eff Effects, rejectedBefore bool) {
	t, tr, m := h.t, h.tr, h.m
	if len(eff.Saves) > 0 && len(eff.Loads) > 0 {
		t.Fatalf("one event both saved and loaded: %+v", eff)
	}
	if len(eff.Loads) > 0 && (rejectedBefore || tr.Load.Spec == nil || !tr.Load.Spec.CanLoad || tr.Load.External <= 0) {
		t.Fatalf("load emitted without an accepted LoadSpec: %+v (rejected before: %v)", tr.Load, rejectedBefore)
	}
	if h.report != nil && len(eff.Saves) > 0 {
		h.checkResave(eff)
	}
	for i := range eff.Saves {
		h.checkSave(&eff.Saves[i])
	}
	for _, sp := range tr.SaveSpans {
		if sp.Job < 0 || sp.Job > tr.SaveJobs || sp.CoveredLow < 0 || sp.CoveredHigh < 0 || sp.CoveredLow > sp.End-sp.Start {
			t.Fatalf("pending save span %+v with %d jobs", sp, tr.SaveJobs)
		}
	}
	for _, id := range tr.StaleSaves {
		if slices.Contains(tr.PendingSaves, id) {
			t.Fatalf("save %s both stale and pending", id)
		}
	}
	for _, l := range eff.Loads {
		if len(l.BlockTable) != len(m.Groups) {
			t.Fatalf("load table has %d groups, model %d", len(l.BlockTable), len(m.Groups))
		}
		if l.Epoch != tr.Epoch {
			t.Fatalf("load of epoch %d emitted in epoch %d", l.Epoch, tr.Epoch)
		}
		h.newID(l.TaskID)
		h.loads = append(h.loads, l.TaskID)
	}
	for _, fb := range eff.Feedback {
		if fb.Kind == kvcore.FeedbackFinishedSending {
			if h.sending++; h.sending > 1 {
				t.Fatal("finished_sending reported twice")
			}
		}
	}
	switch {
	case !tr.Load.Allocated:
		h.rejected = false
	case tr.Load.Resolved && tr.Load.External == 0:
		h.rejected = true
	}
}

// checkSave asserts that an emitted save is structurally valid: the model's
// group count, chunks inside the table and hash chain. Only the block ids
// themselves (null or negative ids the engine gave) may be faulty.
func (h *trackerHarness) checkSave(s *kvcore.SaveTask) {
	t, m := h.t, h.m
	if len(s.BlockTable) != len(m.Groups) {
		t.Fatalf("save table has %d groups, model %d", len(s.BlockTable), len(m.Groups))
	}
	if err := chunksFit(m, s.BlockTable, s.BlockHashes, s.Groups); err != nil {
		t.Fatalf("save chunks outside the task: %v", err)
	}
	if s.Epoch != h.tr.Epoch {
		t.Fatalf("save of epoch %d emitted in epoch %d", s.Epoch, h.tr.Epoch)
	}
	resave := h.report != nil
	if s.End <= s.Start || s.End > h.tr.NumSavedTokens || (!resave && s.End != h.tr.NumSavedTokens) {
		t.Fatalf("save [%d,%d) (re-save %v) with saved offset %d", s.Start, s.End, resave, h.tr.NumSavedTokens)
	}
	for _, v := range kvcore.ValidateSave(m, nil, s) {
		if !v.OK() && v.Reason != kvcore.ReasonNullBlock && v.Reason != kvcore.ReasonBlockOutOfRange {
			t.Fatalf("tracker emitted an invalid save: %+v", v)
		}
	}
	h.newID(s.TaskID)
	h.saves = append(h.saves, s.TaskID)
	depth := 0
	if resave {
		depth = h.emitted[h.index[h.report.id]].depth + 1
	}
	h.index[s.TaskID] = len(h.emitted)
	h.emitted = append(h.emitted, fuzzSave{id: s.TaskID, start: s.Start, end: s.End, epoch: s.Epoch, depth: depth})
}

// checkResave asserts the rules of a save emitted by a save report (a
// re-save): only for a pending save of the current epoch of a running or
// finishing request, reported with the model and not persisted for a
// curable cause (skipped, failed or exists_failed keys); one re-save, inside
// the reported task's range; never a range that one save emitted after the
// reported task covers already (nothing is saved twice needlessly); and at
// most one re-save per later store job (each chain is shorter than the
// epoch's job count), so re-saves end.
func (h *trackerHarness) checkResave(eff Effects) {
	t, tr, rp := h.t, h.tr, h.report
	if len(eff.Saves) != 1 || !rp.model || !rp.current || !unsaved(rp.rep) {
		t.Fatalf("report %+v emitted saves %+v", rp, eff.Saves)
	}
	r := eff.Saves[0]
	i, ok := h.index[rp.id]
	if !ok {
		t.Fatalf("re-save of an unknown save %s", rp.id)
	}
	x := h.emitted[i]
	if x.epoch != r.Epoch || r.Start < x.start || r.End > x.end {
		t.Fatalf("re-save [%d,%d) of epoch %d for save [%d,%d) of epoch %d", r.Start, r.End, r.Epoch, x.start, x.end, x.epoch)
	}
	for _, s := range h.emitted[i+1:] {
		if s.epoch == r.Epoch && s.start <= r.Start && s.end >= r.End {
			t.Fatalf("re-save [%d,%d) of %s, which the later save %s [%d,%d) covers", r.Start, r.End, x.id, s.id, s.start, s.end)
		}
	}
	if depth := x.depth + 1; depth >= tr.SaveJobs {
		t.Fatalf("re-save %d of a chain with %d jobs in the epoch", depth, tr.SaveJobs)
	}
}

func FuzzValidateSave(f *testing.F) {
	for i, m := range fuzzPresets(f) {
		b, err := json.Marshal(validTask(f, m))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, uint8(i), int8(0), uint16(0), int64(0), int64(0), int64(0), int16(0), int16(0))
		f.Add(b, uint8(i), int8(-1), uint16(3), int64(-1), int64(16), int64(-16), int16(1), int16(5))
		f.Add(b, uint8(i), int8(1), uint16(7), int64(1<<40), int64(-32), int64(1<<50), int16(-2), int16(-3))
	}
	f.Add([]byte(`{"schema":"kvmesh.save_task.v1","task_id":"t","engine_id":"e","request_id":"r","model":"dense-8b","start":0,"end":16,"block_table":[],"block_hashes":["aa"],"groups":[{"group":9,"chunks":[]}]}`),
		uint8(0), int8(0), uint16(0), int64(0), int64(0), int64(0), int16(0), int16(0))
	models := fuzzPresets(f)
	f.Fuzz(func(t *testing.T, raw []byte, preset uint8, tableDelta int8, blockAt uint16, blockVal, startDelta, endDelta int64, hashCut, entryGroup int16) {
		m := models[int(preset)%len(models)]
		if task, err := kvcore.DecodeSaveTask(raw); err == nil {
			checkVerdicts(t, m, task, kvcore.ValidateSave(m, nil, task))
			if vs := kvcore.ValidateSave(nil, nil, task); len(vs) != len(task.Groups) {
				t.Fatalf("nil model: %d verdicts for %d entries", len(vs), len(task.Groups))
			}
		}
		task := validTask(t, m)
		mutateTask(task, tableDelta, blockAt, blockVal, startDelta, endDelta, hashCut, entryGroup)
		var pool []int
		if blockAt%3 != 0 {
			pool = []int{int(blockAt % 64), 8, 40}
		}
		checkVerdicts(t, m, task, kvcore.ValidateSave(m, pool, task))
	})
}

// newID asserts task ids are unique.
func (h *trackerHarness) newID(id string) {
	if h.ids[id] {
		h.t.Fatalf("task id %q emitted twice", id)
	}
	h.ids[id] = true
}

// fuzzEvents reads a tracker event sequence from fuzz bytes; reads past
// the end give zeros.
type fuzzEvents struct{ b []byte }

func (r *fuzzEvents) more() bool { return len(r.b) > 0 }

func (r *fuzzEvents) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *fuzzEvents) upTo(n int) int { return int(r.byte()) % (n + 1) }

// table reads a block table: usually the model's group count, sometimes
// nil, empty, one group short or one too many; ids include null and
// negative ones.
func (r *fuzzEvents) table(groups int) kvcore.BlockTable {
	var n int
	switch r.byte() % 16 {
	case 0:
		return nil
	case 1:
		return kvcore.BlockTable{}
	case 2:
		n = groups - 1
	case 3:
		n = groups + 1
	default:
		n = groups
	}
	out := make(kvcore.BlockTable, n)
	for g := range out {
		for range r.upTo(9) {
			switch v := r.byte(); v {
			case 255:
				out[g] = append(out[g], kvcore.NullBlock)
			case 254:
				out[g] = append(out[g], -5)
			default:
				out[g] = append(out[g], kvcore.BlockID(v))
			}
		}
	}
	return out
}

// fuzzSave is an emitted save: its range, epoch and, for a re-save, the
// number of re-saves before it in its chain (0: a step's save).
type fuzzSave struct {
	id                string
	start, end, epoch int
	depth             int
}

// fuzzReport is one save report: the task, what it said, and whether the
// task was a pending save of the current epoch of a running or finishing
// request when it arrived.
type fuzzReport struct {
	id      string
	rep     kvcore.SaveReport
	model   bool
	current bool
}

// trackerSeed encodes a well-formed event sequence in fuzzEvents' format,
// so the seed corpus reaches loads, saves and results.
type trackerSeed struct {
	b      []byte
	groups int
}

func newTrackerSeed(preset, groups int) *trackerSeed {
	return &trackerSeed{b: []byte{byte(preset), 12}, groups: groups}
}

// table encodes a table of the model's group count with n blocks per group.
func (s *trackerSeed) table(n int) *trackerSeed {
	s.b = append(s.b, 4)
	for g := range s.groups {
		s.b = append(s.b, byte(n))
		for i := range n {
			s.b = append(s.b, byte(10*g+i))
		}
	}
	return s
}

func (s *trackerSeed) lookup(cachedBlocks, hitBlocks int) *trackerSeed {
	s.b = append(s.b, 0, 1, byte(cachedBlocks), byte(hitBlocks), 0)
	return s
}

func (s *trackerSeed) allocate(accept bool, blocks int) *trackerSeed {
	mode := byte(0)
	if accept {
		mode = 1
	}
	s.b = append(s.b, 1, mode)
	return s.table(blocks)
}

// step encodes new (2), running (3), resumed (4) or decode (5).
func (s *trackerSeed) step(op byte, tokens, blocks int) *trackerSeed {
	s.b = append(s.b, op, byte(tokens))
	return s.table(blocks)
}

func (s *trackerSeed) op(ops ...byte) *trackerSeed {
	s.b = append(s.b, ops...)
	return s
}

// pick chooses an emitted id, or an unknown one.
func pick(ids []string, r *fuzzEvents) string {
	i := r.upTo(len(ids))
	if i == len(ids) {
		return "unknown"
	}
	return ids[i]
}
