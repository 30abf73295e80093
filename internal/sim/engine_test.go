package sim

import (
	"encoding/json"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// testEngine is an engine with no I/O parts, for the block-manager and
// bookkeeping logic that runs between its calls to the mesh.
func testEngine(t *testing.T, model string, blocks int) (*engine, *[]*request) {
	t.Helper()
	m := preset(t, model)
	var finalized []*request
	hooks := engineHooks{
		generated: func(*request) {}, abandoned: func(*request) {}, peerRead: func(string) {},
		finalized: func(r *request) { finalized = append(finalized, r) },
	}
	deps := engineDeps{model: m, ledger: newLedger(m, "run-", false), stats: newStats(), log: slog.New(slog.DiscardHandler), timeout: time.Minute}
	return newEngine("e", RoleBoth, EngineConfig{PoolBlocks: blocks, MaxBatchTokens: 64, MaxRunning: 4, Watermark: 1}, deps, hooks), &finalized
}

// testRequest is a request of n prompt tokens with ids from base.
func testRequest(e *engine, id string, n int, base uint32) *request {
	r := &request{id: id, prompt: make([]uint32, n), output: []uint32{7, 8, 9}, maxOut: 3, turn: &turnState{}}
	for i := range r.prompt {
		r.prompt[i] = base + uint32(i)
	}
	r.shadow = requeststate.NewTracker(e.model, e.id, id)
	r.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	r.extendHashes(e.model.HashBlockSize)
	return r
}

func TestRequestHashesMatchHashChain(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 8)
	r := testRequest(e, "r", 40, 100)
	r.salt = []byte("salt")
	r.hashes, r.hexes = nil, nil
	r.extendHashes(16)
	r.generated = 3 // 43 tokens: still 2 hash blocks
	r.extendHashes(16)
	tokens := append(slices.Clone(r.prompt), r.output...)
	want := kvcore.HashChain(tokens, 16, []byte("salt"))
	if len(r.hashes) != len(want) {
		t.Fatalf("%d hashes, want %d", len(r.hashes), len(want))
	}
	for i := range want {
		if r.hexes[i] != want[i].Hex() {
			t.Fatalf("hash %d differs from kvcore.HashChain", i)
		}
	}
}

// TestAllocateLayout: chunks before the resume point that no group needs are
// null (the Mamba states before the hit), the rest get blocks.
func TestAllocateLayout(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 32)
	r := testRequest(e, "r", 50, 0)
	if !e.allocate(r, 50, 0, 32) {
		t.Fatal("allocate failed")
	}
	mla, mamba := r.table[0], r.table[1]
	if len(mla) != 4 || len(mamba) != 4 {
		t.Fatalf("table %v: want 4 blocks per group for 50 tokens", r.table)
	}
	if slices.Contains(mla, nullBlockID) {
		t.Fatalf("MLA blocks %v: every chunk is needed", mla)
	}
	if mamba[0] != nullBlockID || slices.Contains(mamba[1:], nullBlockID) {
		t.Fatalf("Mamba blocks %v: only the state before the hit at 32 may be null", mamba)
	}
	// 31 real blocks per group (block 0 is the null block): 4 and 3 taken.
	if e.pool.available(0) != 27 || e.pool.available(1) != 28 {
		t.Fatalf("available %d/%d, want 27/28", e.pool.available(0), e.pool.available(1))
	}
	e.free(r)
	if e.pool.available(0) != 31 || e.pool.available(1) != 31 || r.table != nil {
		t.Fatal("free did not return every block")
	}
}

// cacheChunks registers blocks holding the request's chunks up to end.
func cacheChunks(t *testing.T, e *engine, r *request, end int, skip func(g int, c kvcore.Chunk) bool) {
	t.Helper()
	for g, grp := range e.model.Groups {
		for _, c := range kvcore.Chunks(0, end, grp.BlockSize) {
			if skip(g, c) {
				continue
			}
			b, ok := e.pool.alloc(g)
			if !ok {
				t.Fatal("pool too small")
			}
			e.pool.register(g, b, e.chunkKey(r, c))
			e.pool.release(g, b)
		}
	}
}

func TestLocalHit(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 32)
	r := testRequest(e, "r", 70, 0)
	if h := e.localHit(r, 70); h != 0 {
		t.Fatalf("empty cache: hit %d", h)
	}
	// Every MLA chunk to 64; Mamba states only at 32 and 64.
	cacheChunks(t, e, r, 64, func(g int, c kvcore.Chunk) bool { return g == 1 && c.End != 32 && c.End != 64 })
	if h := e.localHit(r, 70); h != 64 {
		t.Fatalf("hit %d, want 64", h)
	}
	if h := e.localHit(r, 64); h != 32 {
		t.Fatalf("64 tokens: hit %d, want 32 (at least one token is computed; no state at 48)", h)
	}
	if !e.fits(r, 70, 64) {
		t.Fatal("a request that fits does not")
	}
	if !e.allocate(r, 70, 64, 64) {
		t.Fatal("allocate failed")
	}
	for g := range e.model.Groups {
		c := kvcore.Chunk{Start: 48, End: 64}
		if b, _ := e.pool.cached(g, e.chunkKey(r, c)); r.table[g][3] != b {
			t.Fatalf("group %d: the chunk before the hit is block %d, not the cached %d", g, r.table[g][3], b)
		}
	}
	if r.table[1][0] != nullBlockID || r.table[1][1] != nullBlockID {
		t.Fatalf("Mamba blocks %v: states before the local hit are not needed", r.table[1])
	}
}

func TestFitsAndGrow(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 7) // 6 real blocks and the null block
	if _, _, ok := e.everFits(80); ok {
		t.Fatal("80 tokens (5 blocks + 1 to grow) fit a pool of 6 with watermark 1")
	}
	if _, _, ok := e.everFits(64); !ok {
		t.Fatal("64 tokens do not fit a pool of 6")
	}
	r := testRequest(e, "r", 40, 0)
	if !e.fits(r, 40, 0) || !e.allocate(r, 40, 0, 0) {
		t.Fatal("40 tokens do not fit")
	}
	if added, ok := e.grow(r, 48); !ok || added != nil {
		t.Fatalf("grow within the last block: %v, %v", added, ok)
	}
	added, ok := e.grow(r, 49)
	if !ok || len(added[0]) != 1 || len(added[1]) != 1 || len(r.table[0]) != 4 {
		t.Fatalf("grow to 49: %v, %v, table %v", added, ok, r.table)
	}
	other := testRequest(e, "o", 30, 1000)
	if e.fits(other, 30, 0) {
		t.Fatal("30 more tokens fit 2 free blocks with a watermark of 1")
	}
	if _, ok := e.grow(r, 97); ok {
		t.Fatal("grew past the pool")
	}
	if len(r.table[0]) != 4 || e.pool.available(0) != 2 {
		t.Fatal("a failed grow changed the table or the pool")
	}
}

// TestPinsFollowShadowSaves: a save the engine's steps imply pins its
// blocks until the sender reports it.
func TestPinsFollowShadowSaves(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 8)
	r := testRequest(e, "run-1", 40, 0)
	out := newOutbox()
	e.allocate(r, 40, 0, 0)
	e.allocated(out, r, nil, 0, "")
	step := kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: r.table.NormalizeNull(nullBlockID).Clone(), Hashes: r.hexes}
	e.shadowEffects(r, r.shadow.Step(e.model, step))
	k := pinKey{"run-1", span{0, 32}}
	if len(e.pins[k]) != 1 || len(e.pins[k][0]) != 3 { // MLA [0,16) and [16,32), Mamba [16,32)
		t.Fatalf("pins %v, want the save's 3 blocks", e.pins)
	}
	e.free(r)
	if e.pool.available(0) != 5 || e.pool.available(1) != 6 { // 7 real blocks of 8 ids
		t.Fatalf("available %d/%d after free: pinned blocks must stay out", e.pool.available(0), e.pool.available(1))
	}
	e.saveReported(k)
	if e.pool.available(0) != 7 || e.pool.available(1) != 7 || len(e.pins) != 0 {
		t.Fatal("unpin did not return the blocks")
	}
	if got := e.ledger.report().EngineExpectedSaves; got != 1 {
		t.Fatalf("ledger expects %d saves, want 1", got)
	}
	if r.failure != "" {
		t.Fatalf("shadow tracker refused: %s", r.failure)
	}
	recs := stepRecords(e.id, e.model.Name, "run", 1, out.events, contract.MaxStepRequests, maxStepBytes)
	if len(recs) != 1 {
		t.Fatalf("%d step records for 2 events, want 1", len(recs))
	}
	var rec contract.EngineStep
	if err := json.Unmarshal(mustJSON(recs[0]), &rec); err != nil {
		t.Fatal(err)
	}
	if rec.Schema != contract.SchemaEngineStep || rec.EngineID != "e" || rec.Model != e.model.Name || rec.StepID != "e/run/1" || rec.Step != 1 {
		t.Fatalf("step record %+v", rec)
	}
	// vLLM's convention on the wire: the record declares null block id 0,
	// and the allocated table's real blocks are 1 or more.
	if rec.NullBlockID == nil || *rec.NullBlockID != 0 {
		t.Fatalf("step record declares null block id %v, want 0", rec.NullBlockID)
	}
	for _, ev := range rec.Requests {
		for _, ids := range ev.BlockTable {
			if slices.ContainsFunc(ids, func(b kvcore.BlockID) bool { return b < 1 }) {
				t.Fatalf("allocated table %v: a real block below 1", ev.BlockTable)
			}
		}
	}
	var kinds []contract.EventKind
	for _, ev := range rec.Requests {
		kinds = append(kinds, ev.Kind)
		if ev.Seq != int64(len(kinds)) || ev.RequestID != "run-1" || ev.Traceparent != r.traceparent {
			t.Fatalf("event %+v", ev)
		}
	}
	if !slices.Equal(kinds, []contract.EventKind{contract.EventAdmitted, contract.EventAllocated}) {
		t.Fatalf("events %v", kinds)
	}
}

func TestGiveUp(t *testing.T) {
	e, finalized := testEngine(t, "hybrid-mla-linear", 8)
	fresh := testRequest(e, "fresh", 40, 0)
	e.live[fresh.id], e.waiting = fresh, []*request{fresh}
	out := newOutbox()
	e.giveUp(out, fresh, "too big")
	if len(*finalized) != 1 || fresh.failure != "too big" || len(e.waiting) != 0 || !out.empty() {
		t.Fatalf("a request the scheduler never saw: finalized %d, failure %q, events %v", len(*finalized), fresh.failure, out.events)
	}
	known := testRequest(e, "known", 40, 0)
	known.admitted = true
	e.live[known.id], e.waiting = known, []*request{known}
	e.giveUp(out, known, "stuck")
	if known.phase != phaseFinishing || len(*finalized) != 1 || len(out.of(known)) != 1 {
		t.Fatalf("an admitted request must be finished and wait for finished_sending: phase %v", known.phase)
	}
}

func TestPercentiles(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	p := percentiles(d)
	if p.Count != 100 || p.P50 != 50 || p.P90 != 90 || p.P99 != 99 || p.Max != 100 {
		t.Fatalf("%+v", p)
	}
	if (percentiles(nil) != Percentiles{}) {
		t.Fatal("no samples must give zeros")
	}
}

// TestScheduledStepsCarryPrefillTokens: a new step declares the prompt as
// its prefill end and a resumed one every token the request had (vLLM's
// prefill_end_tokens), so the scheduler's tracker saves a resumed
// request's generated tokens too.
func TestScheduledStepsCarryPrefillTokens(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 8)
	r := testRequest(e, "run-1", 40, 0)
	r.generated = 2
	table := kvcore.BlockTable{{1, 2, 3}, {4, 5, 6}}
	out := newOutbox()
	e.advance(out, scheduled{r: r, n: 16, kind: kvcore.StepNew, table: table})
	e.advance(out, scheduled{r: r, n: 16, kind: kvcore.StepResumed, table: table})
	var got []int
	for _, ev := range out.events {
		if ev.Kind == contract.EventScheduled && ev.Step != nil {
			got = append(got, ev.Step.PrefillTokens)
		}
	}
	if !slices.Equal(got, []int{40, 42}) {
		t.Fatalf("prefill tokens of the new and the resumed step %v, want [40 42]", got)
	}
}
