package dataplaneapi_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/dataplaneapi"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// testBlockBytes is the block size of the test model.
const testBlockBytes = 4096

// errStoreDown is the whole-batch error the fake store returns.
var errStoreDown = fmt.Errorf("fake store down: %w", kvstore.ErrUnavailable)

// fakeStore is a kvstore.Memory that records each Put's keys and the most
// Puts in flight at once, answers ErrNoSpace for the keys in noSpace, fails
// a whole Put that carries a key in down, and, when gate is set, holds
// every Put until the test sends on gate.
type fakeStore struct {
	*kvstore.Memory
	noSpace, down map[string]bool
	gate          chan struct{}

	mu       sync.Mutex
	inFlight int
	most     int
	puts     [][]string
}

func newFakeStore() *fakeStore {
	return &fakeStore{Memory: kvstore.NewMemory(kvstore.MemoryOptions{}), noSpace: map[string]bool{}, down: map[string]bool{}}
}

// Put implements kvstore.Store.
func (s *fakeStore) Put(ctx context.Context, items []kvstore.Item) ([]error, error) {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	s.mu.Lock()
	s.inFlight++
	s.most = max(s.most, s.inFlight)
	s.puts = append(s.puts, keys)
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
			return nil, ctx.Err()
		}
	}
	errs := make([]error, len(items))
	var keep []kvstore.Item
	var at []int
	for i, it := range items {
		switch {
		case s.down[it.Key]:
			return nil, errStoreDown
		case s.noSpace[it.Key]:
			errs[i] = fmt.Errorf("fake: %w", kvstore.ErrNoSpace)
		default:
			keep, at = append(keep, it), append(at, i)
		}
	}
	kept, err := s.Memory.Put(ctx, keep)
	if err != nil {
		return nil, err
	}
	for j, i := range at {
		errs[i] = kept[j]
	}
	return errs, nil
}

// counts returns the Puts in flight now and the most at once so far.
func (s *fakeStore) counts() (now, most int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inFlight, s.most
}

// putFixture is a pool of 16 blocks, a put handler over a fake store and a
// data-plane client of it.
type putFixture struct {
	pool   *pool.Pool
	store  *fakeStore
	client *dataplane.Client
	fp     string
}

// newPutFixture streams puts over streams sub-batches of chunkBlocks
// framed blocks each (zero: the defaults).
func newPutFixture(t *testing.T, streams, chunkBlocks int) *putFixture {
	t.Helper()
	m, err := kvcore.ParseModel(fmt.Appendf(nil, "name: put-test\nhash_block_size: 16\ngroups:\n  - {kind: full_attention, block_size: 16, bytes_per_block: %d}\n", testBlockBytes))
	if err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(m, 16)
	if err != nil {
		t.Fatal(err)
	}
	met, err := metrics.New(prometheus.NewRegistry(), func() []pool.GroupStats { return nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &putFixture{pool: p, store: newFakeStore(), fp: m.Fingerprint()}
	r := chi.NewRouter()
	st := dataplaneapi.Streams{N: streams, ChunkBytes: chunkBlocks * (testBlockBytes + dataplane.ValueOverhead(len(f.fp)))}
	dataplaneapi.New(p, f.store, f.fp, 64<<20, met).WithStreams(st).Mount(r)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	f.client = dataplane.NewClient(srv.URL, srv.Client())
	return f
}

// hashOf is a chunk hash named by s.
func hashOf(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// write fills block b with bytes of its own and records hash h; it returns the bytes.
func (f *putFixture) write(t *testing.T, b int, h string) []byte {
	t.Helper()
	data := bytes.Repeat([]byte{byte(b + 1)}, testBlockBytes)
	if err := f.pool.WriteBytes(0, kvcore.BlockID(b), dataplane.Identity{Hash: h, RequestID: "req"}, data); err != nil {
		t.Fatal(err)
	}
	return data
}

// item is the put item of block b with hash h.
func item(b int, h string) dataplane.PutItem {
	return dataplane.PutItem{BlockRef: dataplane.BlockRef{Group: 0, Block: kvcore.BlockID(b)}, Key: fmt.Sprintf("key-%d", b), Hash: h}
}

// TestPutResultsAcrossSubBatches puts 12 blocks in sub-batches of 3, two
// at a time: stored, never written (not held), written with another hash
// (not held), no hash, out of range, no space and already present
// (another writer stored the key first), spread over every sub-batch. Each item's result is what it would be in one batch, the
// stored values are the framed blocks, and nothing not held was sent.
func TestPutResultsAcrossSubBatches(t *testing.T) {
	f := newPutFixture(t, 2, 3)
	want := map[int]dataplane.PutStatus{}
	data := map[int][]byte{}
	var items []dataplane.PutItem
	for b := range 12 {
		h := hashOf(fmt.Sprint(b))
		switch b % 4 {
		case 0, 1:
			data[b] = f.write(t, b, h)
			want[b] = dataplane.PutStored
		case 2:
			want[b] = dataplane.PutNotHeld // never written
		case 3:
			f.write(t, b, hashOf("other"))
			want[b] = dataplane.PutNotHeld
		}
		items = append(items, item(b, h))
	}
	f.store.noSpace["key-5"] = true
	want[5] = dataplane.PutNoSpace
	if errs, err := f.store.Memory.Put(context.Background(), []kvstore.Item{{Key: "key-4", Value: []byte("first")}}); err != nil || errs[0] != nil {
		t.Fatal(err, errs)
	}
	want[4] = dataplane.PutExisting // written once: the first value stays, no bytes counted
	items[9].Hash = ""
	want[9] = dataplane.PutNotHeld
	items = append(items, dataplane.PutItem{BlockRef: dataplane.BlockRef{Group: 0, Block: 99}, Key: "key-99", Hash: hashOf("x")})
	want[12] = dataplane.PutFailed

	results, stored, err := f.client.Put(context.Background(), items)
	if err != nil {
		t.Fatal(err)
	}
	var wantBytes int64
	for i, r := range results {
		if r.Status != want[i] {
			t.Errorf("item %d: %s (%s), want %s", i, r.Status, r.Error, want[i])
		}
		if want[i] == dataplane.PutStored {
			wantBytes += int64(testBlockBytes + dataplane.ValueOverhead(len(f.fp)))
			values, _, err := f.store.Get(context.Background(), []string{items[i].Key})
			if err != nil || !bytes.Equal(values[0], dataplane.EncodeValue(f.fp, data[i])) {
				t.Errorf("item %d: stored value is not the framed block (%v)", i, err)
			}
		}
	}
	if stored != wantBytes {
		t.Errorf("put answered %d bytes stored, want %d", stored, wantBytes)
	}
	for _, keys := range f.store.puts {
		if len(keys) > 3 {
			t.Errorf("a sub-batch of %d keys, limit 3 blocks: %v", len(keys), keys)
		}
		for _, k := range keys {
			if b := k[len("key-"):]; slices.Contains([]string{"2", "3", "6", "7", "9", "10", "11"}, b) {
				t.Errorf("key %s was sent, its block is not held", k)
			}
		}
	}
	if len(f.store.puts) < 3 {
		t.Errorf("%d store Puts, want one per sub-batch with something to send (at least 3)", len(f.store.puts))
	}
}

// TestPutWholeBatchFailureOfOneSubBatch fails the store Put of the last
// of four sub-batches: the put answers 503 (dataplane.ErrUnavailable).
func TestPutWholeBatchFailureOfOneSubBatch(t *testing.T) {
	f := newPutFixture(t, 2, 2)
	var items []dataplane.PutItem
	for b := range 8 {
		h := hashOf(fmt.Sprint(b))
		f.write(t, b, h)
		items = append(items, item(b, h))
	}
	f.store.down["key-7"] = true
	_, _, err := f.client.Put(context.Background(), items)
	if !errors.Is(err, dataplane.ErrUnavailable) {
		t.Fatalf("put with one failing sub-batch: %v, want ErrUnavailable", err)
	}
}

// TestPutConcurrencyIsBounded runs two puts at once with every store Put
// held, and releases the Puts one at a time: together they reach N Puts
// in flight (sub-batches overlap) and never more, since the handler's N
// framing buffers are shared by all its puts.
func TestPutConcurrencyIsBounded(t *testing.T) {
	const streams = 3
	f := newPutFixture(t, streams, 1)
	f.store.gate = make(chan struct{})
	var items []dataplane.PutItem
	for b := range 10 {
		h := hashOf(fmt.Sprint(b))
		f.write(t, b, h)
		items = append(items, item(b, h))
	}
	done := make(chan error, 2)
	for _, part := range [][]dataplane.PutItem{items[:5], items[5:]} {
		go func() {
			results, _, err := f.client.Put(context.Background(), part)
			for i := 0; err == nil && i < len(results); i++ {
				if results[i].Status != dataplane.PutStored {
					err = fmt.Errorf("item %d: %s: %s", i, results[i].Status, results[i].Error)
				}
			}
			done <- err
		}()
	}
	for released := 0; released < len(items); released++ {
		if want := min(streams, len(items)-released); !pollFor(func() bool { now, _ := f.store.counts(); return now == want }) {
			now, _ := f.store.counts()
			t.Fatalf("after %d released: %d Puts in flight, want %d", released, now, want)
		}
		f.store.gate <- struct{}{}
	}
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if _, most := f.store.counts(); most != streams {
		t.Fatalf("at most %d Puts in flight, want exactly %d", most, streams)
	}
}

// pollFor polls cond until it holds or 10 s pass.
func pollFor(cond func() bool) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}
