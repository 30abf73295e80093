package sending_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending/sendingtest"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// smallModel is hybrid-mla-linear's shape (MLA + Mamba, bs 16) with tiny
// blocks, so tests and the fuzzer move little memory.
const smallModel = `
name: small-hybrid
hash_block_size: 16
groups:
  - {kind: mla, block_size: 16, bytes_per_block: 64}
  - {kind: mamba, block_size: 16, bytes_per_block: 96}
`

func mustModel(t testing.TB) *kvcore.Model {
	t.Helper()
	m, err := kvcore.ParseModel([]byte(smallModel))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// blockBytes is the deterministic content of one pool block.
func blockBytes(m *kvcore.Model, g int, b kvcore.BlockID) []byte {
	out := make([]byte, m.Groups[g].BytesPerBlock)
	for i := 0; i+8 <= len(out); i += 8 {
		binary.BigEndian.PutUint64(out[i:], uint64(g)<<56|uint64(b)<<16|uint64(i))
	}
	return out
}

// poolWorker is a gpuworker's put path over a synthetic pool (block bytes
// from blockBytes) and a real kvstore.Store: unit tests of the handler use
// it; the service tests run the real gpuworker binary. Like the real
// worker it answers not_held for an item without a hash, and for the
// blocks a test marks as no longer holding their chunk.
type poolWorker struct {
	model  *kvcore.Model
	store  kvstore.Store
	blocks int

	mu      sync.Mutex
	down    int                         // whole requests to fail before answering again
	puts    int                         // put requests answered
	notHeld map[dataplane.BlockRef]bool // blocks that hold another chunk (or nothing)
	items   []dataplane.PutItem         // every item asked, in order
}

func (w *poolWorker) Put(ctx context.Context, items []dataplane.PutItem) ([]dataplane.PutResult, int64, error) {
	w.mu.Lock()
	if w.down > 0 {
		w.down--
		w.mu.Unlock()
		return nil, 0, fmt.Errorf("test worker down: %w", dataplane.ErrUnavailable)
	}
	w.puts++
	w.items = append(w.items, items...)
	notHeld := w.notHeld
	w.mu.Unlock()
	results := make([]dataplane.PutResult, len(items))
	var batch []kvstore.Item
	var idx []int
	for i, it := range items {
		if it.Group < 0 || it.Group >= len(w.model.Groups) || it.Block < 0 || int64(it.Block) >= int64(w.blocks) {
			results[i] = dataplane.PutResult{Status: dataplane.PutFailed, Error: "block outside the pool"}
			continue
		}
		if it.Hash == "" || notHeld[it.BlockRef] {
			results[i] = dataplane.PutResult{Status: dataplane.PutNotHeld, Error: fmt.Sprintf("block %d holds another chunk; wanted hash %s", it.Block, it.Hash)}
			continue
		}
		batch = append(batch, kvstore.Item{Key: it.Key, Value: dataplane.EncodeValue(w.model.Fingerprint(), blockBytes(w.model, it.Group, it.Block))})
		idx = append(idx, i)
	}
	errs, err := w.store.Put(ctx, batch)
	if err != nil {
		return nil, 0, fmt.Errorf("test worker store: %w: %w", dataplane.ErrUnavailable, err)
	}
	var n int64
	for j, i := range idx {
		switch {
		case errs[j] == nil:
			results[i] = dataplane.PutResult{Status: dataplane.PutStored}
			n += int64(len(batch[j].Value))
		case errors.Is(errs[j], kvstore.ErrExists):
			results[i] = dataplane.PutResult{Status: dataplane.PutExisting}
		case errors.Is(errs[j], kvstore.ErrNoSpace):
			results[i] = dataplane.PutResult{Status: dataplane.PutNoSpace, Error: errs[j].Error()}
		default:
			results[i] = dataplane.PutResult{Status: dataplane.PutFailed, Error: errs[j].Error()}
		}
	}
	return results, n, nil
}

// Read answers like the real worker's read route: each asked block's bytes,
// or NotHeld for a block marked as no longer holding its chunk (or asked
// without a hash).
func (w *poolWorker) Read(_ context.Context, refs []dataplane.ReadRef) ([]dataplane.ReadBlock, error) {
	w.mu.Lock()
	notHeld := w.notHeld
	w.mu.Unlock()
	out := make([]dataplane.ReadBlock, len(refs))
	for i, r := range refs {
		out[i].BlockRef = r.BlockRef
		if r.Hash == "" || notHeld[r.BlockRef] {
			out[i].NotHeld = fmt.Sprintf("block %d holds another chunk; wanted hash %s", r.Block, r.Hash)
			continue
		}
		out[i].Identity = dataplane.Identity{Hash: r.Hash}
		out[i].Data = blockBytes(w.model, r.Group, r.Block)
	}
	return out, nil
}

// setNotHeld marks blocks as no longer holding their chunk.
func (w *poolWorker) setNotHeld(refs ...dataplane.BlockRef) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.notHeld = map[dataplane.BlockRef]bool{}
	for _, r := range refs {
		w.notHeld[r] = true
	}
}

// asked returns every item the worker was asked to put.
func (w *poolWorker) asked() []dataplane.PutItem {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]dataplane.PutItem(nil), w.items...)
}

func (w *poolWorker) setDown(n int) {
	w.mu.Lock()
	w.down = n
	w.mu.Unlock()
}

// engines is Workers with one poolWorker (rank 0) per known engine.
type engines map[string]*poolWorker

func (e engines) Engine(_ context.Context, id string) (map[kvcore.Rank]sending.Putter, error) {
	w, ok := e[id]
	if !ok {
		return nil, fmt.Errorf("engine %q: %w", id, registry.ErrNoWorker)
	}
	return map[kvcore.Rank]sending.Putter{{}: w}, nil
}

func (engines) Forget(string) {}

type fixture struct {
	model  *kvcore.Model
	keys   kvcore.KeyBuilder
	store  kvstore.Store
	worker *poolWorker
	pool   *pgxpool.Pool
	ledger *ledger.Ledger
	p      *sending.Processor
	reg    *prometheus.Registry // the processor's metrics
	now    time.Time
	offset int64
}

type fixtureOption func(*sending.Options)

func newFixture(t testing.TB, pool *pgxpool.Pool, store kvstore.Store, opts ...fixtureOption) *fixture {
	t.Helper()
	m := mustModel(t)
	f := &fixture{model: m, keys: kvcore.KeysOf(m), store: store, pool: pool, ledger: ledger.New(pool),
		worker: &poolWorker{model: m, store: store, blocks: 64}, now: time.Unix(1_800_000_000, 0)}
	f.reg = prometheus.NewRegistry()
	metrics, err := sending.NewMetrics(f.reg)
	if err != nil {
		t.Fatal(err)
	}
	o := sending.Options{
		Model: m, Keys: f.keys, Store: store, Workers: engines{"e1": f.worker}, Ledger: f.ledger, Metrics: metrics,
		Retry: sendpolicy.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: 2 * time.Millisecond},
		Now:   func() time.Time { return f.now },
	}
	for _, opt := range opts {
		opt(&o)
	}
	if f.p, err = sending.New(o); err != nil {
		t.Fatal(err)
	}
	return f
}

// record wraps a value as the next record of kvmesh.save.tasks.
func (f *fixture) record(value []byte) bus.Received {
	f.offset++
	return bus.Received{Message: bus.Message{Topic: contract.TopicSaveTasks, Key: "r", Value: value},
		Partition: 0, Offset: f.offset, Time: time.Unix(1_800_000_000, 0)}
}

// handle runs one record through the handler as the consumer would.
func (f *fixture) handle(t testing.TB, value []byte) bus.Received {
	t.Helper()
	rec := f.record(value)
	f.deliver(t, rec)
	return rec
}

// deliver runs rec through Handle as the consumer loop does: a permanent
// failure goes to the dead-letter hook with its reason. Any other error
// fails the test.
func (f *fixture) deliver(t testing.TB, rec bus.Received) {
	t.Helper()
	err := f.p.Handle(context.Background(), rec)
	var pe *bus.PermanentError
	if errors.As(err, &pe) {
		err = f.p.DeadLetter(context.Background(), rec, pe.Reason, pe.Err)
	}
	if err != nil {
		t.Fatalf("Handle: %v", err)
	}
}

// saveTask builds a valid save task of tokens [start, end) for request id,
// with block ids base+i in every group (sendingtest.SaveTask).
func saveTask(m *kvcore.Model, id string, start, end int, base kvcore.BlockID) *kvcore.SaveTask {
	return sendingtest.SaveTask(m, id, start, end, base)
}

func encode(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// outcome reads the TransferResult recorded for a task.
func (f *fixture) outcome(t testing.TB, taskID string) (contract.TransferResult, bool) {
	t.Helper()
	var body []byte
	err := f.pool.QueryRow(context.Background(), "SELECT result FROM save_outcomes WHERE task_id = $1", taskID).Scan(&body)
	if err != nil {
		return contract.TransferResult{}, false
	}
	var r contract.TransferResult
	if err := json.Unmarshal(body, &r); err != nil {
		t.Fatal(err)
	}
	return r, true
}

// outbox returns the values enqueued on topic, oldest first.
func (f *fixture) outbox(t testing.TB, topic string) [][]byte {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), "SELECT value FROM outbox WHERE topic = $1 ORDER BY id", topic)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out [][]byte
	for rows.Next() {
		var v []byte
		if err := rows.Scan(&v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v)
	}
	return out
}

// deadLetters returns the dead letters of one record offset.
func (f *fixture) deadLetters(t testing.TB, offset int64) []deadletter.DeadLetter {
	t.Helper()
	ctx := context.Background()
	rows, err := f.pool.Query(ctx, `SELECT id FROM dead_letters WHERE "offset" = $1 ORDER BY id`, offset)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	out := make([]deadletter.DeadLetter, 0, len(ids))
	for _, id := range ids {
		d, err := f.ledger.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

// keysOf lists the store keys of a task's group, in chunk order.
func (f *fixture) keysOf(t testing.TB, task *kvcore.SaveTask, g int) []string {
	t.Helper()
	items, err := kvcore.PlanSend(f.model, f.keys, task, g, kvcore.Rank{})
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.Key
	}
	return out
}
