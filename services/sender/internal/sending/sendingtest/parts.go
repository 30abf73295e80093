package sendingtest

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

var (
	_ sending.Store   = (*Store)(nil)
	_ sending.Putter  = (*GPUWorker)(nil)
	_ sending.Workers = (*Workers)(nil)
)

// Store is sending.Store in memory: a set of keys, whose existence checks
// can be told to fail. It is safe for concurrent use.
type Store struct {
	mu     sync.Mutex
	keys   map[string]bool
	fail   int
	checks int
}

// NewStore returns a store holding keys.
func NewStore(keys ...string) *Store {
	s := &Store{keys: map[string]bool{}}
	s.Add(keys...)
	return s
}

// Add puts keys in the store.
func (s *Store) Add(keys ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		s.keys[k] = true
	}
}

// Has reports whether key is in the store.
func (s *Store) Has(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.keys[key]
}

// Keys lists the keys in the store, sorted.
func (s *Store) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.keys))
	for k := range s.keys {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// FailExists makes the next n existence checks fail with ErrInjected.
func (s *Store) FailExists(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fail = n
}

// Checks counts the existence checks asked for, failed ones included.
func (s *Store) Checks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checks
}

// Exists reports, for each key, whether it is present.
func (s *Store) Exists(ctx context.Context, keys []string) ([]bool, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks++
	if s.fail > 0 {
		s.fail--
		return nil, fmt.Errorf("store exists: %w", ErrInjected)
	}
	out := make([]bool, len(keys))
	for i, k := range keys {
		out[i] = s.keys[k]
	}
	return out, nil
}

// take stores key unless present and reports whether it did.
func (s *Store) take(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.keys[key] {
		return false
	}
	s.keys[key] = true
	return true
}

// GPUWorker is a gpuworker's put path (sending.Putter) over a Store: it puts
// each item's key (BytesPerItem bytes), answers existing for a key already
// there, and answers as told for the keys and blocks a test names. Whole
// requests can be told to fail. It is safe for concurrent use.
type GPUWorker struct {
	// Store receives the keys put.
	Store *Store
	// BytesPerItem is the framed size counted per item stored (0: 64).
	BytesPerItem int64

	mu      sync.Mutex
	down    int
	reject  bool
	answers map[string]dataplane.PutStatus
	blocks  map[dataplane.BlockRef]dataplane.PutStatus
	asked   []dataplane.PutItem
	puts    int
}

// Down makes the next n put requests fail whole with
// dataplane.ErrUnavailable (a worker that is unreachable).
func (w *GPUWorker) Down(n int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.down = n
}

// Reject makes every put request fail whole with dataplane.ErrRejected.
func (w *GPUWorker) Reject() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.reject = true
}

// AnswerKey makes the worker answer status for key.
func (w *GPUWorker) AnswerKey(key string, status dataplane.PutStatus) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.answers == nil {
		w.answers = map[string]dataplane.PutStatus{}
	}
	w.answers[key] = status
}

// AnswerBlock makes the worker answer status for every item of block b
// (dataplane.PutNotHeld: the block no longer holds its chunk).
func (w *GPUWorker) AnswerBlock(b dataplane.BlockRef, status dataplane.PutStatus) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.blocks == nil {
		w.blocks = map[dataplane.BlockRef]dataplane.PutStatus{}
	}
	w.blocks[b] = status
}

// Asked returns every item asked in requests that were answered.
func (w *GPUWorker) Asked() []dataplane.PutItem {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]dataplane.PutItem(nil), w.asked...)
}

// Requests counts the put requests, failed ones included.
func (w *GPUWorker) Requests() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.puts
}

// Put answers each item, in order, with the bytes stored.
func (w *GPUWorker) Put(ctx context.Context, items []dataplane.PutItem) ([]dataplane.PutResult, int64, error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.puts++
	switch {
	case w.reject:
		return nil, 0, fmt.Errorf("test worker: %w", dataplane.ErrRejected)
	case w.down > 0:
		w.down--
		return nil, 0, fmt.Errorf("test worker down: %w", dataplane.ErrUnavailable)
	}
	w.asked = append(w.asked, items...)
	size := w.BytesPerItem
	if size <= 0 {
		size = 64
	}
	out := make([]dataplane.PutResult, len(items))
	var n int64
	for i, it := range items {
		status, told := w.answers[it.Key]
		if !told {
			status, told = w.blocks[it.BlockRef]
		}
		switch {
		case told && status == dataplane.PutStored:
			w.Store.Add(it.Key)
			n += size
		case told:
		case w.Store.take(it.Key):
			status = dataplane.PutStored
			n += size
		default:
			status = dataplane.PutExisting
		}
		out[i] = dataplane.PutResult{Status: status}
		if status != dataplane.PutStored && status != dataplane.PutExisting {
			out[i].Error = fmt.Sprintf("test worker answered %s for block %d of group %d", status, it.Block, it.Group)
		}
	}
	return out, n, nil
}

// Workers is sending.Workers with one GPUWorker answering for every rank of
// every engine except those listed in Missing.
type Workers struct {
	// Model lists the ranks (kvcore.Model.WorkerRanks).
	Model *kvcore.Model
	// GPU answers every rank.
	GPU *GPUWorker

	mu      sync.Mutex
	missing map[string]bool
	forgot  int
}

// Remove makes engine have no live worker (registry.ErrNoWorker).
func (ws *Workers) Remove(engine string) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.missing == nil {
		ws.missing = map[string]bool{}
	}
	ws.missing[engine] = true
}

// Forgotten counts the Forget calls (one per failed put attempt).
func (ws *Workers) Forgotten() int {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.forgot
}

// Engine returns the GPUWorker for every rank of engineID.
func (ws *Workers) Engine(_ context.Context, engineID string) (map[kvcore.Rank]sending.Putter, error) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.missing[engineID] {
		return nil, fmt.Errorf("engine %q: %w", engineID, registry.ErrNoWorker)
	}
	out := map[kvcore.Rank]sending.Putter{}
	for _, r := range ws.Model.WorkerRanks() {
		out[r] = ws.GPU
	}
	return out, nil
}

// Forget counts a failure.
func (ws *Workers) Forget(string) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	ws.forgot++
}
