package sim

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// ledgerFixture builds save tasks and results for the hybrid model.
type ledgerFixture struct {
	t      *testing.T
	m      *kvcore.Model
	l      *ledger
	mu     sync.Mutex
	saved  []span
	hashes []string
}

func newLedgerFixture(t *testing.T) *ledgerFixture {
	f := &ledgerFixture{t: t, m: preset(t, "hybrid-mla-linear")}
	f.l = newLedger(f.m, "run-", false)
	f.l.onSaved = func(_, _ string, rep savedReport) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.saved = append(f.saved, rep.span)
	}
	for _, h := range kvcore.HashChain(make([]uint32, 128), 16, nil) {
		f.hashes = append(f.hashes, h.Hex())
	}
	return f
}

// task publishes a save of [start, end) for request req (a 2-group table
// covering end).
func (f *ledgerFixture) task(id, req string, start, end int) kvcore.SaveTask {
	n := end / 16
	table := kvcore.BlockTable{make([]kvcore.BlockID, n), make([]kvcore.BlockID, n)}
	t := kvcore.SaveTask{
		Schema: kvcore.SchemaSaveTask, TaskID: id, EngineID: "e", RequestID: req, Model: f.m.Name,
		Start: start, End: end, BlockTable: table, BlockHashes: f.hashes[:n], Groups: f.m.SaveGroups(start, end),
	}
	f.l.saveTask(Record{Key: req, Value: mustJSON(t)})
	return t
}

func (f *ledgerFixture) result(taskID, req string, groups ...contract.GroupOutcome) {
	r := contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "r-" + taskID, Kind: contract.TransferSave,
		TaskID: taskID, EngineID: "e", RequestID: req, Status: "stored", Groups: groups, Bytes: 10}
	f.l.transferResult(Record{Key: req, Value: mustJSON(r)})
}

func TestLedgerBalanced(t *testing.T) {
	f := newLedgerFixture(t)
	f.l.expectSave("e", "run-1", span{0, 48})
	f.l.expectSave("e", "run-1", span{48, 64})
	// [0,48): 3 MLA chunks + 1 Mamba state; [48,64): 1 + 1.
	f.result("t2", "run-1", contract.GroupOutcome{Group: 0, Stored: 1}, contract.GroupOutcome{Group: 1, Skipped: 1})
	f.task("t1", "run-1", 0, 48)
	f.task("t2", "run-1", 48, 64) // its result came first
	if n := f.l.outstanding(); n != 1 {
		t.Fatalf("outstanding %d, want 1 (t1's result)", n)
	}
	f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 2, Existing: 1}, contract.GroupOutcome{Group: 1, DeadLettered: 1})
	f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 3}) // a redelivered duplicate
	f.task("t1", "run-1", 0, 48)                                        // a republished duplicate
	f.l.saveTask(Record{Key: "other", Value: []byte("{not json")})      // not the run's: ignored
	f.task("x1", "other-run", 0, 16)                                    // not the run's: ignored
	rep := f.l.report()
	if !rep.Balanced || len(rep.Differences) != 0 {
		t.Fatalf("not balanced: %+v", rep)
	}
	want := LedgerReport{LedgerCounts: LedgerCounts{SaveTasks: 2, Reported: 2, ExpectedChunks: 6, Stored: 3, Existing: 1, Skipped: 1,
		DeadLettered: 1, EngineExpectedSaves: 2}, DuplicateTasks: 1, DuplicateResults: 1, SaveBytes: 20}
	if rep.SaveTasks != want.SaveTasks || rep.Reported != want.Reported || rep.ExpectedChunks != want.ExpectedChunks ||
		rep.Stored != want.Stored || rep.Existing != want.Existing || rep.Skipped != want.Skipped ||
		rep.DeadLettered != want.DeadLettered || rep.EngineExpectedSaves != want.EngineExpectedSaves ||
		rep.DuplicateTasks != want.DuplicateTasks || rep.DuplicateResults != want.DuplicateResults || rep.SaveBytes != want.SaveBytes {
		t.Fatalf("report %+v\nwant %+v", rep, want)
	}
	if len(f.saved) != 2 {
		t.Fatalf("onSaved fired %d times, want once per task: %v", len(f.saved), f.saved)
	}
	if got := f.l.deadLettered(); len(got) != 1 || got[0] != "e/run-1" {
		t.Fatalf("deadLettered = %v", got)
	}
}

// TestLedgerWorkerRestarts: under Config.WorkerRestarts keys failed for
// put_failed are accounted and the request must be in the DLQ; keys failed
// for another reason stay a difference.
func TestLedgerWorkerRestarts(t *testing.T) {
	for _, tc := range []struct {
		name     string
		restarts bool
		reason   string
		balanced bool
	}{
		{"put_failed under restarts", true, "put_failed", true},
		{"put_failed without restarts", false, "put_failed", false},
		{"other failure under restarts", true, "exists_failed", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newLedgerFixture(t)
			f.l.putFailuresAccounted = tc.restarts
			f.l.expectSave("e", "run-1", span{0, 16})
			f.task("t1", "run-1", 0, 16)
			f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Failed: 1, Reason: tc.reason}, contract.GroupOutcome{Group: 1, Stored: 1})
			rep := f.l.report()
			if rep.Balanced != tc.balanced {
				t.Fatalf("balanced %v, want %v: %+v", rep.Balanced, tc.balanced, rep.Differences)
			}
			listed := slices.Contains(f.l.deadLettered(), "e/run-1")
			if listed != tc.balanced {
				t.Fatalf("deadLettered lists the request: %v, want %v", listed, tc.balanced)
			}
		})
	}
}

func TestLedgerDifferences(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(f *ledgerFixture)
		want  string
	}{
		{"no result", func(f *ledgerFixture) {
			f.l.expectSave("e", "run-1", span{0, 16})
			f.task("t1", "run-1", 0, 16)
		}, "no result reported"},
		{"keys unaccounted", func(f *ledgerFixture) {
			f.l.expectSave("e", "run-1", span{0, 32})
			f.task("t1", "run-1", 0, 32)
			f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 1}, contract.GroupOutcome{Group: 1, Stored: 1})
		}, "asked for 3 keys, result accounts for 2"},
		{"failed keys", func(f *ledgerFixture) {
			f.l.expectSave("e", "run-1", span{0, 16})
			f.task("t1", "run-1", 0, 16)
			f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Failed: 1, Reason: "put_failed"}, contract.GroupOutcome{Group: 1, Stored: 1})
		}, "1 keys failed (put_failed)"},
		{"save never published", func(f *ledgerFixture) {
			f.l.expectSave("e", "run-1", span{0, 16})
		}, "implied by the engine's steps was published 0 time(s)"},
		{"save not expected", func(f *ledgerFixture) {
			f.task("t1", "run-1", 0, 16)
			f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 1}, contract.GroupOutcome{Group: 1, Stored: 1})
		}, "published 1 time(s), the engine's steps imply 0"},
		{"malformed table", func(f *ledgerFixture) {
			f.l.expectSave("e", "run-1", span{0, 16})
			task := f.task("t1", "run-1", 0, 16)
			task.TaskID, task.BlockTable = "t2", kvcore.BlockTable{}
			f.l.saveTask(Record{Key: "run-1", Value: mustJSON(task)})
			f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 1}, contract.GroupOutcome{Group: 1, Stored: 1})
			f.result("t2", "run-1", contract.GroupOutcome{Group: 0, DeadLettered: 1}, contract.GroupOutcome{Group: 1, DeadLettered: 1})
		}, "block table does not cover"},
		{"undecodable run record", func(f *ledgerFixture) {
			f.l.saveTask(Record{Key: "run-9", Value: []byte("garbage")})
		}, "undecodable save records"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newLedgerFixture(t)
			tc.setup(f)
			rep := f.l.report()
			if rep.Balanced {
				t.Fatalf("balanced: %+v", rep)
			}
			var all []string
			for _, d := range rep.Differences {
				all = append(all, d.Problem)
			}
			if !strings.Contains(strings.Join(all, "\n"), tc.want) {
				t.Fatalf("differences %q lack %q", all, tc.want)
			}
		})
	}
}

func TestLedgerLoadResults(t *testing.T) {
	f := newLedgerFixture(t)
	r := contract.TransferResult{Kind: contract.TransferLoad, TaskID: "l1", RequestID: "run-1", Bytes: 100, LoadErrors: []kvcore.BlockID{3, 4}}
	b, _ := json.Marshal(r)
	f.l.transferResult(Record{Value: b})
	f.l.transferResult(Record{Value: b})
	rep := f.l.report()
	if rep.LoadTasks != 1 || rep.LoadBytes != 100 || rep.LoadErrorBlocks != 2 || !rep.Balanced {
		t.Fatalf("load accounting %+v", rep)
	}
}

// TestLedgerCoverageAfterPreemption: a request preempted with saves in
// flight is compared by the tokens its saves cover (the re-save after the
// preemption races the report of the save it repeats); other requests stay
// compared span by span.
func TestLedgerCoverageAfterPreemption(t *testing.T) {
	for name, tc := range map[string]struct {
		raced     bool
		expected  []span
		published []span
		balanced  bool
	}{
		"re-save the scheduler skipped": {raced: true, expected: []span{{0, 48}, {0, 48}}, published: []span{{0, 48}}, balanced: true},
		"re-save the engine skipped":    {raced: true, expected: []span{{0, 32}, {32, 48}}, published: []span{{0, 32}, {0, 48}}, balanced: true},
		"tokens never saved":            {raced: true, expected: []span{{0, 32}, {32, 64}}, published: []span{{0, 32}}},
		"tokens saved beyond":           {raced: true, expected: []span{{0, 32}}, published: []span{{0, 64}}},
		"not preempted: span by span":   {expected: []span{{0, 48}, {0, 48}}, published: []span{{0, 48}}},
	} {
		t.Run(name, func(t *testing.T) {
			f := newLedgerFixture(t)
			if tc.raced {
				f.l.preemptedInFlight("e", "run-1")
			}
			for _, s := range tc.expected {
				f.l.expectSave("e", "run-1", s)
			}
			for i, s := range tc.published {
				f.task(fmt.Sprint("t", i), "run-1", s.Start, s.End)
			}
			var diffs []LedgerDifference
			for _, d := range f.l.report().Differences {
				if d.TaskID == "" { // span differences only: the tasks have no results here
					diffs = append(diffs, d)
				}
			}
			if (len(diffs) == 0) != tc.balanced {
				t.Fatalf("differences %v, want balanced %v", diffs, tc.balanced)
			}
		})
	}
}

func TestUnionAndUncovered(t *testing.T) {
	u := union([]span{{32, 48}, {0, 16}, {16, 32}, {64, 80}, {70, 72}, {5, 5}})
	if !slices.Equal(u, []span{{0, 48}, {64, 80}}) {
		t.Fatalf("union %v", u)
	}
	if got := uncovered(u, []span{{16, 32}, {64, 70}}); !slices.Equal(got, []span{{0, 16}, {32, 48}, {70, 80}}) {
		t.Fatalf("uncovered %v", got)
	}
	if got := uncovered(u, u); len(got) != 0 {
		t.Fatalf("a set covers itself: %v", got)
	}
}

// TestLedgerPerRank: at TP8 the expected keys of a save split over the
// ranks that write them (each MLA chunk by one rank in turn, every rank
// its own linear-attention states), the stored keys are attributed to
// their writer through their namespace and chunk, and a stored key no rank
// writes unbalances the ledger.
func TestLedgerPerRank(t *testing.T) {
	f := newLedgerFixture(t)
	f.m = tpModel(t, 8)
	f.l = newLedger(f.m, "run-", false)
	f.l.expectSave("e", "run-1", span{0, 64})
	task := f.task("t1", "run-1", 0, 64)
	states := len(task.Groups[1].Chunks)
	f.result("t1", "run-1", contract.GroupOutcome{Group: 0, Stored: 4}, contract.GroupOutcome{Group: 1, Stored: 1, Existing: 8*states - 1})
	kb := kvcore.KeysOf(f.m).WithPrefix("dep")
	hash := func(i int) kvcore.BlockHash { h, _ := hex.DecodeString(f.hashes[i]); return h }
	var keys []string
	for c := range 4 {
		keys = append(keys, kb.Key(kvcore.Rank{}, 0, hash(c))) // the MLA namespace
	}
	last := task.Groups[1].Chunks[states-1]
	keys = append(keys, kb.Key(kvcore.Rank{TP: 5}, 1, hash(last.HashIndex(16))))
	for _, rec := range storedRecords(t, "e", "run-1", keys) {
		f.l.kvEvent(rec)
	}
	rep := f.l.report()
	if !rep.Balanced || !rep.RanksBalanced || len(rep.Ranks) != 8 {
		t.Fatalf("not balanced per rank: %+v", rep)
	}
	for k, rl := range rep.Ranks {
		wantExp, wantStored := states, 0
		if k < 4 {
			wantExp, wantStored = states+1, 1
		}
		if k == 5 {
			wantStored++
		}
		if rl.EngineID != "e" || rl.Rank.TP != k || rl.ExpectedKeys != wantExp || rl.StoredKeys != wantStored || !rl.Balanced {
			t.Fatalf("rank %d: %+v, want %d expected, %d stored", k, rl, wantExp, wantStored)
		}
	}
	stray := kb.Key(kvcore.Rank{TP: 3}, 0, hash(0)) // MLA has no tp_rank:3 namespace
	for _, rec := range storedRecords(t, "e", "run-1", []string{stray}) {
		f.l.kvEvent(rec)
	}
	rep = f.l.report()
	if rep.Balanced || rep.RanksBalanced || rep.RanksUnattributed != 1 {
		t.Fatalf("a key no rank writes: balanced %v, per rank %v, unattributed %d", rep.Balanced, rep.RanksBalanced, rep.RanksUnattributed)
	}
}

// TestLedgerRankLoadResults: a multi-rank load has one result per rank;
// each counts, a redelivered one does not.
func TestLedgerRankLoadResults(t *testing.T) {
	f := newLedgerFixture(t)
	for _, id := range []string{"l1/tp0", "l1/tp1", "l1/tp1"} {
		r := contract.TransferResult{Kind: contract.TransferLoad, ResultID: id, TaskID: "l1", RequestID: "run-1", Bytes: 10}
		f.l.transferResult(Record{Value: mustJSON(r)})
	}
	if rep := f.l.report(); rep.LoadTasks != 1 || rep.LoadResults != 2 || rep.LoadBytes != 20 {
		t.Fatalf("load accounting %+v", rep)
	}
}

// storedRecords are the kvmesh.kv.events records the sender publishes for
// keys stored by one request: one BlockStored record per store namespace.
func storedRecords(t *testing.T, engine, request string, keys []string) []Record {
	t.Helper()
	var order []string
	byNS := map[string][]string{}
	for _, k := range keys {
		ns, h, ok := kvcore.SplitKey(k)
		if !ok {
			t.Fatalf("key %q", k)
		}
		if _, seen := byNS[ns]; !seen {
			order = append(order, ns)
		}
		byNS[ns] = append(byNS[ns], h)
	}
	var out []Record
	for _, ns := range order {
		var wire []uint64
		for _, h := range byNS[ns] {
			b, err := kvcore.ParseBlockHash(h)
			if err != nil {
				t.Fatal(err)
			}
			wire = append(wire, contract.WireHash(b))
		}
		key, value, headers, err := contract.EncodeKVEventRecord(contract.KVEventRecord{
			Batch:     contract.KVEventBatch{TS: 1, Events: []contract.KVEvent{{Kind: contract.BlockStored, BlockHashes: wire, TokenIDs: []uint32{}}}},
			Namespace: ns, Hashes: byNS[ns], EngineID: engine, RequestID: request,
		}, contract.KVEventFormMap)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, Record{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers})
	}
	return out
}

// TestLedgerRemovedKeys: a BlockRemoved record marks its keys removed, for
// the stored-value check's count of announced evictions; a BlockStored
// record does not.
func TestLedgerRemovedKeys(t *testing.T) {
	m := preset(t, "hybrid-mla-linear")
	l := newLedger(m, "run-", false)
	kb := kvcore.KeysOf(m).WithPrefix("dep")
	hashes := kvcore.HashChain(make([]uint32, 32), 16, []byte("salt"))
	removed, kept := kb.Key(kvcore.Rank{}, 0, hashes[0]), kb.Key(kvcore.Rank{}, 0, hashes[1])
	ns, h, ok := kvcore.SplitKey(removed)
	if !ok {
		t.Fatalf("key %q", removed)
	}
	key, value, headers, err := contract.EncodeKVEventRecord(contract.KVEventRecord{
		Batch:     contract.KVEventBatch{TS: 1, Events: []contract.KVEvent{{Kind: contract.BlockRemoved, BlockHashes: []uint64{contract.WireHash(hashes[0])}}}},
		Namespace: ns, Hashes: []string{h},
	}, contract.KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	l.kvEvent(Record{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers})
	for _, rec := range storedRecords(t, "e", "run-1", []string{kept}) {
		l.kvEvent(rec)
	}
	if !l.wasRemoved(removed) || l.wasRemoved(kept) {
		t.Fatalf("removed: %v %v, want true false", l.wasRemoved(removed), l.wasRemoved(kept))
	}
	if keys, _ := l.storedKeys(); len(keys) != 1 || keys[0] != kept {
		t.Fatalf("stored keys %v, want only %s", keys, kept)
	}
}
