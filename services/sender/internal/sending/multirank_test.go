package sending_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// tp4Model is smallModel (MLA + Mamba) at TP4: the MLA group has one
// namespace (tp_rank:0) whose chunks the four ranks stripe; the Mamba
// group has one namespace per rank, each written by its own rank.
const tp4Model = `
name: small-hybrid-tp4
hash_block_size: 16
groups:
  - {kind: mla, block_size: 16, bytes_per_block: 64}
  - {kind: mamba, block_size: 16, bytes_per_block: 96}
parallel: {tp: 4}
`

// rankWorkers is Workers for one engine ("e1") with a putter per worker
// rank; a rank without one has no live worker. With stuck set, every
// registry look-up hangs until its context ends.
type rankWorkers struct {
	mu      sync.Mutex
	putters map[kvcore.Rank]sending.Putter
	stuck   bool
}

func (w *rankWorkers) Engine(ctx context.Context, id string) (map[kvcore.Rank]sending.Putter, error) {
	w.mu.Lock()
	stuck := w.stuck
	out := make(map[kvcore.Rank]sending.Putter, len(w.putters))
	for r, p := range w.putters {
		out[r] = p
	}
	w.mu.Unlock()
	if stuck {
		<-ctx.Done()
		return nil, fmt.Errorf("registry look-up: %w", ctx.Err())
	}
	if id != "e1" || len(out) == 0 {
		return nil, fmt.Errorf("engine %q: %w", id, registry.ErrNoWorker)
	}
	return out, nil
}

func (*rankWorkers) Forget(string) {}

// set gives rank r the putter p (nil: no live worker).
func (w *rankWorkers) set(r kvcore.Rank, p sending.Putter) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if p == nil {
		delete(w.putters, r)
		return
	}
	w.putters[r] = p
}

// barrier holds every put until n are in flight at once (or 5 s passed),
// so a test proves that the ranks' puts overlap.
type barrier struct {
	n    int
	mu   sync.Mutex
	in   int
	most int
	open chan struct{}
	once sync.Once
}

func newBarrier(n int) *barrier { return &barrier{n: n, open: make(chan struct{})} }

// barrierPutter is a putter whose puts wait at a barrier first.
type barrierPutter struct {
	sending.Putter
	b *barrier
}

func (p barrierPutter) Put(ctx context.Context, items []dataplane.PutItem) ([]dataplane.PutResult, int64, error) {
	b := p.b
	b.mu.Lock()
	b.in++
	if b.in > b.most {
		b.most = b.in
	}
	if b.in >= b.n {
		b.once.Do(func() { close(b.open) })
	}
	b.mu.Unlock()
	select {
	case <-b.open:
	case <-ctx.Done():
	case <-time.After(5 * time.Second): // too few overlap: the test fails on most
		b.once.Do(func() { close(b.open) })
	}
	b.mu.Lock()
	b.in--
	b.mu.Unlock()
	return p.Putter.Put(ctx, items)
}

// newRankFixture is newFixture for the TP4 model with one poolWorker per
// worker rank; with inFlight > 0 each put waits until inFlight puts are in
// flight at once.
func newRankFixture(t testing.TB, pool *pgxpool.Pool, inFlight int, opts ...fixtureOption) (*fixture, *rankWorkers, map[kvcore.Rank]*poolWorker, *barrier) {
	t.Helper()
	m, err := kvcore.ParseModel([]byte(tp4Model))
	if err != nil {
		t.Fatal(err)
	}
	store := kvstore.NewMemory(kvstore.MemoryOptions{})
	f := &fixture{model: m, keys: kvcore.KeysOf(m), store: store, pool: pool, ledger: ledger.New(pool),
		now: time.Unix(1_800_000_000, 0)}
	b := newBarrier(inFlight)
	ws := &rankWorkers{putters: map[kvcore.Rank]sending.Putter{}}
	byRank := map[kvcore.Rank]*poolWorker{}
	for _, r := range m.WorkerRanks() {
		byRank[r] = &poolWorker{model: m, store: store, blocks: 64}
		var p sending.Putter = byRank[r]
		if inFlight > 0 {
			p = barrierPutter{Putter: p, b: b}
		}
		ws.set(r, p)
	}
	metrics, err := sending.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	o := sending.Options{
		Model: m, Keys: f.keys, Store: store, Workers: ws, Ledger: f.ledger, Metrics: metrics,
		Retry: sendpolicy.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: 2 * time.Millisecond},
		Now:   func() time.Time { return f.now },
	}
	for _, opt := range opts {
		opt(&o)
	}
	if f.p, err = sending.New(o); err != nil {
		t.Fatal(err)
	}
	return f, ws, byRank, b
}

// rankKeys lists the keys worker rank r writes for every group of task.
func (f *fixture) rankKeys(t testing.TB, task *kvcore.SaveTask, r kvcore.Rank) []string {
	t.Helper()
	var out []string
	for _, gc := range task.Groups {
		items, err := kvcore.PlanSend(f.model, f.keys, task, gc.Group, r)
		if err != nil {
			t.Fatal(err)
		}
		for _, it := range items {
			out = append(out, it.Key)
		}
	}
	return out
}

// TestTP4EveryKeyPutOnceThroughItsRanksWorker saves 128 tokens of the TP4
// model: the eight MLA chunks are striped over the four ranks (two each,
// all in tp_rank:0) and each rank puts its own Mamba state, every key
// exactly once through the worker of the rank that writes it, the four
// ranks' puts in flight at once.
func TestTP4EveryKeyPutOnceThroughItsRanksWorker(t *testing.T) {
	f, _, byRank, b := newRankFixture(t, dbtest.NewPool(t), 4)
	task := saveTask(f.model, "tp4", 0, 128, 0)
	f.handle(t, encode(t, task))

	res, ok := f.outcome(t, task.TaskID)
	want := []contract.GroupOutcome{{Group: 0, Stored: 8}, {Group: 1, Stored: 4}}
	if !ok || res.Status != "stored" || !equalGroups(res.Groups, want) {
		t.Fatalf("result %+v, want stored %+v", res, want)
	}
	seen := map[string]kvcore.Rank{}
	for _, r := range f.model.WorkerRanks() {
		var got []string
		for _, it := range byRank[r].asked() {
			if prev, dup := seen[it.Key]; dup {
				t.Errorf("key %s put by %s and %s", it.Key, prev, r)
			}
			seen[it.Key] = r
			got = append(got, it.Key)
		}
		if wantKeys := f.rankKeys(t, task, r); !slices.Equal(got, wantKeys) || len(got) != 3 {
			t.Errorf("rank %s's worker put %q, want its 2 MLA chunks and its Mamba state %q", r, got, wantKeys)
		}
	}
	for _, k := range keysOfMap(seen) {
		if strings.Contains(k, "@group:0@") && !strings.Contains(k, "@tp_rank:0@") {
			t.Errorf("MLA key %s outside the one namespace tp_rank:0", k)
		}
	}
	if len(seen) != 12 {
		t.Errorf("%d distinct keys put, want 12 (8 MLA + 4 Mamba)", len(seen))
	}
	if b.most != 4 {
		t.Errorf("at most %d ranks' puts were in flight at once, want 4", b.most)
	}
	if n := len(f.outbox(t, contract.TopicKVEvents)); n != 5 {
		t.Errorf("%d kv event records, want one per group and namespace (1 MLA + 4 Mamba)", n)
	}
}

func keysOfMap(m map[string]kvcore.Rank) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// TestTP4RankWithoutWorkerDeadLettersItsPartOnly saves with rank tp2's
// worker missing from the registry: after the retries its MLA chunks and
// its Mamba state are dead-lettered put_failed, one dead letter per group
// naming the rank; the other ranks' keys are stored and the task's result
// is recorded. The three live ranks' puts overlap. A replay once the
// worker is back stores the rest of the group through it.
func TestTP4RankWithoutWorkerDeadLettersItsPartOnly(t *testing.T) {
	f, ws, _, b := newRankFixture(t, dbtest.NewPool(t), 3)
	lost := kvcore.Rank{TP: 2}
	ws.set(lost, nil)
	task := saveTask(f.model, "lost", 0, 128, 0)
	rec := f.handle(t, encode(t, task))

	res, ok := f.outcome(t, task.TaskID)
	want := []contract.GroupOutcome{{Group: 0, Stored: 6, Failed: 2, Reason: "put_failed"}, {Group: 1, Stored: 3, Failed: 1, Reason: "put_failed"}}
	if !ok || res.Status != "failed" || !equalGroups(res.Groups, want) {
		t.Fatalf("result %+v, want failed %+v", res, want)
	}
	if n := len(f.outbox(t, contract.TopicTransferResults)); n != 1 {
		t.Fatalf("%d transfer results, want 1", n)
	}
	if b.most != 3 {
		t.Errorf("at most %d ranks' puts were in flight at once, want the 3 live ones", b.most)
	}
	dls := f.deadLetters(t, rec.Offset)
	if len(dls) != 2 {
		t.Fatalf("%d dead letters, want one per group of rank %s: %+v", len(dls), lost, dls)
	}
	for g, d := range dls {
		if d.Reason != "put_failed" || d.Group == nil || *d.Group != g ||
			!strings.HasPrefix(d.Detail, "rank tp2-pcp0-dcp0-pp0: ") || !strings.Contains(d.Detail, "no live gpuworker") {
			t.Errorf("dead letter %+v, want put_failed of group %d naming rank %s", d, g, lost)
		}
	}
	lostKeys := f.rankKeys(t, task, lost)
	for _, r := range f.model.WorkerRanks() {
		keys := f.rankKeys(t, task, r)
		found, err := f.store.Exists(context.Background(), keys)
		if err != nil {
			t.Fatal(err)
		}
		for i, ok := range found {
			if ok == (r == lost) {
				t.Errorf("rank %s key %s: in the store %v", r, keys[i], ok)
			}
		}
	}

	lw := &poolWorker{model: f.model, store: f.store, blocks: 64}
	ws.set(lost, lw)
	if _, err := f.p.Replay(context.Background(), dls[0].ID); err != nil {
		t.Fatalf("replay of group 0 with the worker back: %v", err)
	}
	var got []string
	for _, it := range lw.asked() {
		got = append(got, it.Key)
	}
	if !slices.Equal(got, lostKeys[:2]) {
		t.Fatalf("the replay put %q through rank %s, want only its MLA chunks %q", got, lost, lostKeys[:2])
	}
}

// TestTP4StuckRegistryIsRetriedThenDeadLettered: every registry look-up
// hangs; each attempt ends at the put timeout, and after the retries every
// rank's part is dead-lettered put_failed and the result recorded — the
// task is never held.
func TestTP4StuckRegistryIsRetriedThenDeadLettered(t *testing.T) {
	f, ws, _, _ := newRankFixture(t, dbtest.NewPool(t), 0, func(o *sending.Options) { o.PutTimeout = 50 * time.Millisecond })
	ws.mu.Lock()
	ws.stuck = true
	ws.mu.Unlock()
	task := saveTask(f.model, "stuck", 0, 64, 0)
	start := time.Now()
	rec := f.handle(t, encode(t, task))
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the save took %s with a stuck registry", took)
	}
	res, ok := f.outcome(t, task.TaskID)
	if !ok || res.Status != "failed" {
		t.Fatalf("result %+v (recorded %v), want failed", res, ok)
	}
	dls := f.deadLetters(t, rec.Offset)
	ranks := map[string]bool{}
	for _, d := range dls {
		if d.Reason != "put_failed" || !strings.Contains(d.Detail, "failed 3 times") {
			t.Errorf("dead letter %+v, want put_failed after 3 attempts", d)
		}
		ranks[strings.SplitN(d.Detail, ":", 2)[0]] = true
	}
	if len(ranks) != 4 {
		t.Errorf("dead letters name %v, want each of the 4 ranks", ranks)
	}
}

// TestTP4DryRunNamesTheWritingRank: a dry run lists each missing key with
// the worker rank that writes it (MLA chunks in tp_rank:0 by ranks 0..3)
// and fails put_failed naming a rank without a live worker.
func TestTP4DryRunNamesTheWritingRank(t *testing.T) {
	f, ws, _, _ := newRankFixture(t, dbtest.NewPool(t), 0)
	lost := kvcore.Rank{TP: 1}
	ws.set(lost, nil)
	task := saveTask(f.model, "dry", 0, 64, 0)
	rec := f.handle(t, encode(t, task))
	dls := f.deadLetters(t, rec.Offset)
	if len(dls) == 0 {
		t.Fatal("no dead letter for the lost rank")
	}
	dr, err := f.p.DryRun(context.Background(), dls[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if dr.Expect != sending.ExpectFail || dr.Reason != "put_failed" || !strings.Contains(dr.Detail, "rank tp1-pcp0-dcp0-pp0") {
		t.Fatalf("dry run %+v, want fail put_failed naming rank tp1", dr)
	}
	if len(dr.Groups) != 1 || len(dr.Groups[0].Keys) != 4 || dr.Groups[0].Missing != 1 {
		t.Fatalf("dry run groups %+v, want group 0's 4 keys, 1 missing", dr.Groups)
	}
	for _, k := range dr.Groups[0].Keys {
		r := kvcore.Rank{TP: int(k.Block) % 4}
		if k.Rank != r.String() || !strings.Contains(k.Key, "tp_rank:0@") || (*k.Exists) == (r == lost) {
			t.Errorf("key %+v, want written by %s into tp_rank:0, present unless rank %s", k, r, lost)
		}
	}

	ws.set(lost, &poolWorker{model: f.model, store: f.store, blocks: 64})
	if dr, err = f.p.DryRun(context.Background(), dls[0].ID); err != nil || dr.Expect != sending.ExpectSave {
		t.Fatalf("dry run with the worker back: %+v, %v; want save", dr, err)
	}
	if _, err := f.p.Replay(context.Background(), 999999); !errors.Is(err, deadletter.ErrNotFound) {
		t.Fatalf("replay of an unknown id: %v", err)
	}
}

// TestRegistryServesConcurrentRankLookups: the ranks of one task look their
// engine up at once; each gets every live rank's putter, and an engine
// without workers is a registry.ErrNoWorker error.
func TestRegistryServesConcurrentRankLookups(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	for _, r := range []kvcore.Rank{{TP: 0}, {TP: 1}} {
		if err := registry.Register(ctx, pool, registry.Worker{EngineID: "e1", Rank: r, Addr: "http://127.0.0.1:1"}); err != nil {
			t.Fatal(err)
		}
	}
	reg := sending.NewRegistry(pool, time.Minute, nil)
	defer reg.Close()
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ps, err := reg.Engine(ctx, "e1")
			if err == nil && (len(ps) != 2 || ps[kvcore.Rank{TP: 1}] == nil) {
				err = fmt.Errorf("putters %v, want ranks tp0 and tp1", ps)
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	reg.Forget("e1")
	if _, err := reg.Engine(ctx, "e2"); !errors.Is(err, registry.ErrNoWorker) {
		t.Fatalf("engine without workers: %v, want ErrNoWorker", err)
	}
}
