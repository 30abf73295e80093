package load_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/load"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// streamBlockBytes is the block size of the streaming tests' model.
const streamBlockBytes = 4096

// gatedStore is a kvstore.Memory that fails a whole Get carrying a key in
// down, records the most Gets in flight at once and, when gate is set,
// holds every Get until the test sends on gate.
type gatedStore struct {
	*kvstore.Memory
	down map[string]bool
	gate chan struct{}

	mu             sync.Mutex
	inFlight, most int
}

// Get implements kvstore.Store.
func (s *gatedStore) Get(ctx context.Context, keys []string) ([][]byte, []error, error) {
	s.mu.Lock()
	s.inFlight++
	s.most = max(s.most, s.inFlight)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inFlight--
		s.mu.Unlock()
	}()
	if s.gate != nil {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
	for _, k := range keys {
		if s.down[k] {
			return nil, nil, fmt.Errorf("fake: %w", kvstore.ErrUnavailable)
		}
	}
	return s.Memory.Get(ctx, keys)
}

// counts returns the Gets in flight now and the most at once so far.
func (s *gatedStore) counts() (now, most int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inFlight, s.most
}

// streamFixture is a loader streaming sub-batches of chunkBlocks values,
// streams at once, from a gated store, into a pool of 16 blocks; and the
// load task of a 12-block prompt (blocks 0..11) whose values are stored.
type streamFixture struct {
	loader   *load.Loader
	store    *gatedStore
	pool     *pool.Pool
	task     *kvcore.LoadTask
	fp       string
	keys     []string
	payloads [][]byte
}

func newStreamFixture(t *testing.T, streams, chunkBlocks int) *streamFixture {
	t.Helper()
	m, err := kvcore.ParseModel(fmt.Appendf(nil, "name: stream-test\nhash_block_size: 16\ngroups:\n  - {kind: full_attention, block_size: 16, bytes_per_block: %d}\n", streamBlockBytes))
	if err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(m, 16)
	if err != nil {
		t.Fatal(err)
	}
	met, err := metrics.New(prometheus.NewRegistry(), func() []pool.GroupStats { return p.Stats(m) }, nil)
	if err != nil {
		t.Fatal(err)
	}
	toks := make([]uint32, 12*16)
	for i := range toks {
		toks[i] = uint32(9000 + i)
	}
	var hashes []string
	for _, h := range kvcore.HashChain(toks, m.HashBlockSize, nil) {
		hashes = append(hashes, h.Hex())
	}
	table := kvcore.BlockTable{make([]kvcore.BlockID, 12)}
	for i := range table[0] {
		table[0][i] = kvcore.BlockID(i)
	}
	f := &streamFixture{pool: p, fp: m.Fingerprint(), store: &gatedStore{Memory: kvstore.NewMemory(kvstore.MemoryOptions{}), down: map[string]bool{}},
		task: &kvcore.LoadTask{
			Schema: kvcore.SchemaLoadTask, TaskID: "task-stream", EngineID: "e", RequestID: "req-stream",
			Model: m.Name, Connector: "store", Start: 0, End: len(toks), BlockHashes: hashes,
			BlockTable: table, Groups: m.LoadGroups(0, len(toks)),
		}}
	kb := kvcore.KeysOf(m)
	items, err := kvcore.PlanLoad(m, kb, f.task, kvcore.Rank{})
	if err != nil || len(items) != 12 {
		t.Fatalf("PlanLoad: %d items, %v", len(items), err)
	}
	for i, it := range items {
		payload := bytes.Repeat([]byte{byte(i + 1)}, streamBlockBytes)
		f.keys, f.payloads = append(f.keys, it.Key), append(f.payloads, payload)
		if _, err := f.store.Put(context.Background(), []kvstore.Item{{Key: it.Key, Value: dataplane.EncodeValue(m.Fingerprint(), payload)}}); err != nil {
			t.Fatal(err)
		}
	}
	f.loader = load.New(load.Config{
		Model: m, Keys: kb, EngineID: "e", Pool: p, Store: f.store, Publisher: &published{},
		MaxBatchBytes: 1 << 20, Streams: streams, ChunkBytes: chunkBlocks * (streamBlockBytes + dataplane.ValueOverhead(len(m.Fingerprint()))),
		Metrics: met, Log: slog.New(slog.DiscardHandler),
	})
	return f
}

// TestLoadErrorsPerBlockAcrossSubBatches loads 12 blocks in sub-batches
// of 3, two at a time, with a missing key in the first sub-batch, a
// corrupted value in the second and a whole-Get failure of the third:
// exactly those blocks are load errors, in block order, every other block
// holds its payload under the chunk's hash, and the bytes count them.
func TestLoadErrorsPerBlockAcrossSubBatches(t *testing.T) {
	f := newStreamFixture(t, 2, 3)
	ctx := context.Background()
	if _, err := f.store.Remove(ctx, []string{f.keys[1]}); err != nil {
		t.Fatal(err)
	}
	corrupt := dataplane.EncodeValue(f.fp, f.payloads[4])
	corrupt[len(corrupt)-1] ^= 0x01
	if _, err := f.store.Remove(ctx, []string{f.keys[4]}); err != nil { // values are written once
		t.Fatal(err)
	}
	if errs, err := f.store.Put(ctx, []kvstore.Item{{Key: f.keys[4], Value: corrupt}}); err != nil || errs[0] != nil {
		t.Fatal(err, errs)
	}
	f.store.down[f.keys[7]] = true // blocks 6, 7 and 8 share a sub-batch

	res := f.loader.Load(ctx, f.task)
	want := []kvcore.BlockID{1, 4, 6, 7, 8}
	if !slices.Equal(res.LoadErrors, want) {
		t.Fatalf("load errors %v, want %v", res.LoadErrors, want)
	}
	if wantBytes := int64((12 - len(want)) * streamBlockBytes); res.Bytes != wantBytes {
		t.Errorf("bytes %d, want %d", res.Bytes, wantBytes)
	}
	for i := range 12 {
		got, err := f.pool.Copy(0, kvcore.BlockID(i), f.task.BlockHashes[i])
		if failed := slices.Contains(want, kvcore.BlockID(i)); failed != (err != nil) {
			t.Errorf("block %d: held error %v, load error %v", i, err, failed)
		} else if !failed && !bytes.Equal(got, f.payloads[i]) {
			t.Errorf("block %d holds other bytes than its stored payload", i)
		}
	}
}

// TestLoadConcurrencyIsBounded holds every Get and releases them one at a
// time: the load reaches Streams Gets in flight (sub-batches overlap) and
// never more, and every block is loaded.
func TestLoadConcurrencyIsBounded(t *testing.T) {
	const streams = 3
	f := newStreamFixture(t, streams, 1)
	f.store.gate = make(chan struct{})
	done := make(chan []kvcore.BlockID, 1)
	go func() { done <- f.loader.Load(context.Background(), f.task).LoadErrors }()
	for released := 0; released < 12; released++ {
		want := min(streams, 12-released)
		deadline := time.Now().Add(10 * time.Second)
		for now, _ := f.store.counts(); now != want; now, _ = f.store.counts() {
			if time.Now().After(deadline) {
				t.Fatalf("after %d released: %d Gets in flight, want %d", released, now, want)
			}
			time.Sleep(time.Millisecond) // polling interval of a deadline-bounded wait
		}
		f.store.gate <- struct{}{}
	}
	if errs := <-done; len(errs) != 0 {
		t.Fatalf("load errors %v", errs)
	}
	if _, most := f.store.counts(); most != streams {
		t.Fatalf("at most %d Gets in flight, want exactly %d", most, streams)
	}
}
