package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// driver applies engine steps to one engine's requests through a ledger
// and, beside it, to in-memory requests, so the stored state can be
// compared with what the state machine alone computes.
type driver struct {
	t     *testing.T
	l     *ledger.Ledger
	m     *kvcore.Model
	step  int
	seq   map[string]int64
	twins map[string]*requeststate.Request
}

func newDriver(t *testing.T, pool *pgxpool.Pool, m *kvcore.Model) *driver {
	return &driver{t: t, l: ledger.New(pool, m), m: m, seq: map[string]int64{}, twins: map[string]*requeststate.Request{}}
}

// apply applies one step record with evs (request id → event) in order.
func (d *driver) apply(evs ...contract.RequestEvent) {
	d.t.Helper()
	d.step++
	u := ledger.Unit{Record: ledger.Record{Kind: ledger.KindStep, ID: fmt.Sprint("e1/", d.step), EngineID: "e1"}}
	for _, ev := range evs {
		d.seq[ev.RequestID]++
		ev.Seq = d.seq[ev.RequestID]
		twin := d.twins[ev.RequestID]
		if twin == nil {
			twin = requeststate.New(d.m, "e1", ev.RequestID)
			d.twins[ev.RequestID] = twin
		}
		twin.Engine(d.m, d.m.Name, ev)
		u.Changes = append(u.Changes, ledger.Change{RequestID: ev.RequestID, Create: true,
			Apply: func(req *requeststate.Request) ([]bus.Message, error) {
				req.Engine(d.m, d.m.Name, ev)
				return nil, nil
			}})
	}
	st, err := d.l.ApplyBatch(context.Background(), []ledger.Unit{u})
	if err != nil || st[0] != ledger.Applied {
		d.t.Fatalf("step %d: %v %v", d.step, st, err)
	}
}

// check compares the stored request with its twin, through l.
func (d *driver) check(l *ledger.Ledger, id string) {
	d.t.Helper()
	row, err := l.Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: id})
	if err != nil {
		d.t.Fatal(err)
	}
	got, _ := row.Request()
	want := d.twins[id]
	if !reflect.DeepEqual(got.Store.Hashes, want.Store.Hashes) {
		d.t.Fatalf("%s: stored chain has %d hashes, want %d", id, len(got.Store.Hashes), len(want.Store.Hashes))
	}
	if !reflect.DeepEqual(got.Store.Table, want.Store.Table) {
		d.t.Fatalf("%s: stored table %v, want %v", id, got.Store.Table, want.Store.Table)
	}
	g, w := *got.Store, *want.Store
	g.Hashes, g.Table, w.Hashes, w.Table = nil, nil, nil, nil
	if !reflect.DeepEqual(g, w) {
		d.t.Fatalf("%s: stored tracker\n%+v\nwant\n%+v", id, g, w)
	}
}

func hexChain(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%064x", i+1)
	}
	return out
}

func blocks(first, n int) []kvcore.BlockID {
	out := make([]kvcore.BlockID, n)
	for i := range out {
		out[i] = kvcore.BlockID(first + i)
	}
	return out
}

func scheduled(id string, kind kvcore.StepKind, tokens int, table kvcore.BlockTable, hashes []string) contract.RequestEvent {
	return contract.RequestEvent{RequestID: id, Kind: contract.EventScheduled,
		Step: &kvcore.Step{Kind: kind, Tokens: tokens, Table: table, Hashes: hashes}}
}

func TestPartsAreWrittenOnceAndReadBack(t *testing.T) {
	pool := dbtest.NewPool(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, pool, m)
	const prompt = 2048
	chain := hexChain(prompt / m.HashBlockSize)
	bs := m.Groups[0].BlockSize
	d.apply(contract.RequestEvent{RequestID: "r1", Kind: contract.EventAdmitted, PromptTokens: prompt, BlockHashes: chain},
		contract.RequestEvent{RequestID: "r1", Kind: contract.EventAllocated, BlockTable: kvcore.BlockTable{blocks(0, 32)}})
	d.apply(scheduled("r1", kvcore.StepNew, 512, kvcore.BlockTable{blocks(0, 32)}, chain))
	for i := 1; i < prompt/512; i++ {
		d.apply(scheduled("r1", kvcore.StepRunning, 512*(i+1), kvcore.BlockTable{blocks(32*i, 512/bs)}, nil))
	}
	d.check(d.l, "r1")
	// A ledger with an empty cache reads the segments.
	d.check(ledger.New(pool, m), "r1")

	ctx := context.Background()
	var jsonHashes, segments, hashSegs int
	if err := pool.QueryRow(ctx, `SELECT coalesce(jsonb_array_length(tracker->'block_hashes'), 0),
		(SELECT count(*) FROM tracker_blocks), (SELECT count(*) FROM tracker_hashes) FROM trackers`).Scan(&jsonHashes, &segments, &hashSegs); err != nil {
		t.Fatal(err)
	}
	if jsonHashes != 0 || hashSegs != 1 || segments != prompt/512 {
		t.Fatalf("tracker JSON holds %d hashes, %d hash segments, %d block segments; want 0, 1, %d", jsonHashes, hashSegs, segments, prompt/512)
	}

	// Preempted and resumed: a new table generation replaces the old rows.
	d.apply(contract.RequestEvent{RequestID: "r1", Kind: contract.EventPreempted})
	d.apply(scheduled("r1", kvcore.StepResumed, prompt, kvcore.BlockTable{blocks(500, prompt/bs)}, chain))
	d.check(d.l, "r1")
	d.check(ledger.New(pool, m), "r1")
	var gens, rows int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT gen), count(*) FROM tracker_blocks`).Scan(&gens, &rows); err != nil {
		t.Fatal(err)
	}
	if gens != 1 || rows != 1 {
		t.Fatalf("%d generations in %d rows after the resume, want 1 in 1", gens, rows)
	}
	// A second ledger (another replica) applies the next event from the
	// segments, and the first one's cache notices the row changed.
	other := &driver{t: t, l: ledger.New(pool, m), m: m, step: d.step, seq: d.seq, twins: d.twins}
	other.apply(scheduled("r1", kvcore.StepDecode, prompt+1, kvcore.BlockTable{{9999}}, nil))
	d.step = other.step
	d.apply(scheduled("r1", kvcore.StepDecode, prompt+bs+1, kvcore.BlockTable{{10000}}, nil))
	d.check(d.l, "r1")
	d.check(ledger.New(pool, m), "r1")
}

// tokenIDs is n token ids whose values use all 32 bits.
func tokenIDs(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i) * 2654435761
	}
	return out
}

// TestTokensAreWrittenOnce checks how a request's token ids are kept: one
// tracker_tokens row of 4 bytes a token, written at admission and not
// rewritten by later events (its row version stays), none in the tracker
// JSON, read back by a ledger whose cache misses, and written again only
// when a longer list arrives.
func TestTokensAreWrittenOnce(t *testing.T) {
	pool := dbtest.NewPool(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, pool, m)
	const prompt = 1024
	chain := hexChain(prompt / m.HashBlockSize)
	bs := m.Groups[0].BlockSize
	ctx := context.Background()
	version := func() (xmin string, size, jsonTokens int) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT k.xmin::text, octet_length(k.tokens), coalesce(jsonb_array_length(t.tracker->'token_ids'), 0)
			FROM tracker_tokens k JOIN trackers t USING (engine_id, request_id)`).Scan(&xmin, &size, &jsonTokens); err != nil {
			t.Fatal(err)
		}
		return xmin, size, jsonTokens
	}
	d.apply(contract.RequestEvent{RequestID: "r1", Kind: contract.EventAdmitted, PromptTokens: prompt, BlockHashes: chain,
		TokenIDs: tokenIDs(prompt / 2), LoraName: "sql-lora"})
	first, size, inJSON := version()
	if size != 4*prompt/2 || inJSON != 0 {
		t.Fatalf("tracker_tokens holds %d bytes, the tracker JSON %d token ids; want %d, 0", size, inJSON, 4*prompt/2)
	}
	d.apply(scheduled("r1", kvcore.StepNew, prompt, kvcore.BlockTable{blocks(0, prompt/bs)}, chain))
	d.apply(scheduled("r1", kvcore.StepDecode, prompt+1, kvcore.BlockTable{{kvcore.BlockID(prompt)}}, nil))
	if again, _, _ := version(); again != first {
		t.Fatalf("the token row was rewritten by events without tokens (xmin %s, then %s)", first, again)
	}
	d.check(d.l, "r1")
	d.check(ledger.New(pool, m), "r1")
	d.apply(contract.RequestEvent{RequestID: "r1", Kind: contract.EventAdmitted, PromptTokens: prompt, BlockHashes: chain,
		TokenIDs: tokenIDs(prompt)})
	if again, size, _ := version(); again == first || size != 4*prompt {
		t.Fatalf("after a longer list: xmin %s (was %s), %d bytes; want a new row version of %d bytes", again, first, size, 4*prompt)
	}
	d.check(ledger.New(pool, m), "r1")
}

// TestEventCostIndependentOfPromptLength checks what an event writes: the
// tracker row's JSON of a running request does not grow with its prompt.
func TestEventCostIndependentOfPromptLength(t *testing.T) {
	pool := dbtest.NewPool(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, pool, m)
	bs := m.Groups[0].BlockSize
	size := map[int]int{}
	for _, prompt := range []int{2048, 32768} {
		id := fmt.Sprint("r", prompt)
		chain := hexChain(prompt / m.HashBlockSize)
		d.apply(contract.RequestEvent{RequestID: id, Kind: contract.EventAdmitted, PromptTokens: prompt, BlockHashes: chain,
			TokenIDs: tokenIDs(prompt)})
		d.apply(scheduled(id, kvcore.StepNew, prompt, kvcore.BlockTable{blocks(0, prompt/bs)}, chain))
		d.apply(scheduled(id, kvcore.StepDecode, prompt+1, kvcore.BlockTable{{kvcore.BlockID(prompt)}}, nil))
		d.check(d.l, id)
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT octet_length(tracker::text) + octet_length(extras::text)
			FROM trackers WHERE request_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		size[prompt] = n
	}
	if size[32768] > size[2048]*3/2 {
		t.Fatalf("the row an event rewrites holds %d bytes at 32K tokens, %d at 2K: more than 1.5x", size[32768], size[2048])
	}
}

// TestLegacyRowIsMovedToSegments reads a row written before migration
// 0006 (chain and table inline, parts NULL) and moves its parts out at
// the next event.
func TestLegacyRowIsMovedToSegments(t *testing.T) {
	pool := dbtest.NewPool(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tr := requeststate.NewTracker(m, "e1", "old")
	tr.OnAdmit(hexChain(8), 128)
	tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: kvcore.BlockTable{blocks(0, 4)}})
	tb, err := requeststate.MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO trackers (engine_id, request_id, model, state, tracker, extras, last_seq)
		VALUES ('e1', 'old', $1, $2, $3, '{}', 2)`, m.Name, string(tr.State), tb); err != nil {
		t.Fatal(err)
	}
	l := ledger.New(pool, m)
	row, err := l.Get(ctx, ledger.Key{EngineID: "e1", RequestID: "old"})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := row.Request(); len(got.Store.Hashes) != 8 || len(got.Store.Table[0]) != 4 {
		t.Fatalf("legacy row read as %d hashes, table %v", len(got.Store.Hashes), got.Store.Table)
	}
	_, err = l.Apply(ctx, ledger.Record{Kind: ledger.KindStep, ID: "s3", EngineID: "e1", RequestID: "old", Create: true},
		func(req *requeststate.Request) ([]bus.Message, error) {
			ev := scheduled("old", kvcore.StepRunning, 128, kvcore.BlockTable{blocks(4, 4)}, nil)
			ev.Seq = 3
			req.Engine(m, m.Name, ev)
			return nil, nil
		})
	if err != nil {
		t.Fatal(err)
	}
	row, err = ledger.New(pool, m).Get(ctx, ledger.Key{EngineID: "e1", RequestID: "old"})
	if err != nil {
		t.Fatal(err)
	}
	got, _ := row.Request()
	if len(got.Store.Hashes) != 8 || !reflect.DeepEqual(got.Store.Table, kvcore.BlockTable{blocks(0, 8)}) {
		t.Fatalf("after the update: %d hashes, table %v", len(got.Store.Hashes), got.Store.Table)
	}
	var inline int
	if err := pool.QueryRow(ctx, `SELECT coalesce(jsonb_array_length(tracker->'block_hashes'), 0) FROM trackers`).Scan(&inline); err != nil || inline != 0 {
		t.Fatalf("%d hashes still inline, %v", inline, err)
	}
}

// TestDownMigrationFoldsPartsBack reverts migration 0006 under a tracker
// with segments: its chain and table are back in the JSON, and after
// migrating up again the ledger reads the same request.
func TestDownMigrationFoldsPartsBack(t *testing.T) {
	pool := dbtest.NewPool(t)
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, pool, m)
	chain := hexChain(8)
	tbl := func(first, n int) kvcore.BlockTable {
		t := kvcore.BlockTable{blocks(first, n), blocks(100+first, n)}
		t[1][0] = kvcore.NullBlock
		return t
	}
	d.apply(contract.RequestEvent{RequestID: "r1", Kind: contract.EventAdmitted, PromptTokens: 128, BlockHashes: chain})
	d.apply(scheduled("r1", kvcore.StepNew, 64, tbl(0, 4), chain))
	d.apply(scheduled("r1", kvcore.StepRunning, 128, tbl(4, 4), nil))
	ctx := context.Background()
	if _, err := database.MigrateDown(ctx, pool, migrations.FS, migrationsFrom(t, "0006")); err != nil {
		t.Fatal(err)
	}
	var tb []byte
	if err := pool.QueryRow(ctx, `SELECT tracker FROM trackers WHERE request_id = 'r1'`).Scan(&tb); err != nil {
		t.Fatal(err)
	}
	folded, err := requeststate.UnmarshalTracker(tb)
	if err != nil {
		t.Fatal(err)
	}
	want := d.twins["r1"].Store
	if !reflect.DeepEqual(folded.Hashes, want.Hashes) || !reflect.DeepEqual(folded.Table, want.Table) {
		t.Fatalf("folded back: %d hashes, table %v; want %d, %v", len(folded.Hashes), folded.Table, len(want.Hashes), want.Table)
	}
	if _, err := database.Migrate(ctx, pool, migrations.FS); err != nil {
		t.Fatal(err)
	}
	d.check(ledger.New(pool, m), "r1")
}

// migrationsFrom counts the up migrations numbered first or later: the
// steps down to the version before first.
func migrationsFrom(t *testing.T, first string) int {
	t.Helper()
	ups, err := fs.Glob(migrations.FS, "*.up.sql")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range ups {
		if f >= first {
			n++
		}
	}
	return n
}

// TestCorruptPartsFailTheApply: a segment missing under a row's parts meta
// is reported as ErrPartsCorrupt, never read as a shorter table.
func TestCorruptPartsFailTheApply(t *testing.T) {
	pool := dbtest.NewPool(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, pool, m)
	chain := hexChain(8)
	d.apply(contract.RequestEvent{RequestID: "r1", Kind: contract.EventAdmitted, PromptTokens: 128, BlockHashes: chain})
	d.apply(scheduled("r1", kvcore.StepNew, 64, kvcore.BlockTable{blocks(0, 4)}, chain))
	d.apply(scheduled("r1", kvcore.StepRunning, 128, kvcore.BlockTable{blocks(4, 4)}, nil))
	if _, err := pool.Exec(context.Background(), `DELETE FROM tracker_blocks WHERE start > 0`); err != nil {
		t.Fatal(err)
	}
	fresh := ledger.New(pool, m) // no cache: reads the segments
	_, err = fresh.Apply(context.Background(), ledger.Record{Kind: ledger.KindStep, ID: "x", EngineID: "e1", RequestID: "r1", Create: true},
		func(*requeststate.Request) ([]bus.Message, error) { return nil, nil })
	if !errors.Is(err, ledger.ErrPartsCorrupt) {
		t.Fatalf("apply over a missing segment: %v, want ErrPartsCorrupt", err)
	}
	if _, err := fresh.Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: "r1"}); !errors.Is(err, ledger.ErrPartsCorrupt) {
		t.Fatalf("get over a missing segment: %v, want ErrPartsCorrupt", err)
	}
}
