package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// evictRecorder is a gpuworker that records its evict calls.
type evictRecorder struct {
	mu    sync.Mutex
	calls [][]dataplane.BlockRef
}

func (w *evictRecorder) start(t *testing.T) *dataplane.Client {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, req *http.Request) {
		if req.URL.Path != dataplane.PathEvict {
			http.NotFound(rw, req)
			return
		}
		var er dataplane.EvictRequest
		if err := json.NewDecoder(req.Body).Decode(&er); err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		w.mu.Lock()
		w.calls = append(w.calls, er.Blocks)
		w.mu.Unlock()
		_ = json.NewEncoder(rw).Encode(dataplane.EvictResponse{Evicted: len(er.Blocks)})
	}))
	t.Cleanup(srv.Close)
	return dataplane.NewClient(srv.URL, srv.Client())
}

// savingRequest admits a request of n tokens and runs its first step, so
// that its shadow tracker emits a save that pins its blocks.
func savingRequest(t *testing.T, e *engine, id string, n int) *request {
	t.Helper()
	r := testRequest(e, id, n, 0)
	if !e.allocate(r, n, 0, 0) {
		t.Fatal("allocate failed")
	}
	for g := range r.table {
		for _, b := range r.table[g] {
			if b != nullBlockID {
				e.pool.hold(g, b) // computed
			}
		}
	}
	out := newOutbox()
	e.allocated(out, r, nil, 0, "")
	e.shadowEffects(r, r.shadow.Step(e.model, kvcore.Step{Kind: kvcore.StepNew, Tokens: n, Table: r.table.NormalizeNull(nullBlockID).Clone(), Hashes: r.hexes}))
	e.running = append(e.running, r)
	r.phase = phaseRunning
	if r.failure != "" || len(e.pins) != 1 {
		t.Fatalf("failure %q, pins %v", r.failure, e.pins)
	}
	return r
}

// TestPreemptWithSavesInFlight: with reusePreempted a preemption frees the
// request's blocks at once although its save is not reported; the next
// allocations reuse them, declare them evicted in one call, and count them
// as reused while a save was pending. Without it, the blocks stay pinned.
func TestPreemptWithSavesInFlight(t *testing.T) {
	for _, reuse := range []bool{true, false} {
		e, _ := testEngine(t, "hybrid-mla-linear", 9) // 8 real blocks and the null block
		e.reusePreempted = reuse
		w := &evictRecorder{}
		e.ranks = []*rankWorker{{client: w.start(t)}}
		r := savingRequest(t, e, "run-1", 40) // 3 blocks per group; the save [0,32) pins 3
		k := pinKey{"run-1", span{0, 32}}
		e.preempt(newOutbox(), r)
		wantAvail := 8
		if !reuse {
			wantAvail = 8 - 2 // MLA [0,16), [16,32) stay pinned
		}
		if got := e.pool.available(0); got != wantAvail {
			t.Fatalf("reuse %v: %d blocks available after the preemption, want %d", reuse, got, wantAvail)
		}
		other := testRequest(e, "run-2", 8*16-32, 1000) // takes every block it can
		if !e.allocate(other, min(6, e.pool.available(0)-1)*16, 0, 0) {
			t.Fatalf("reuse %v: allocate failed", reuse)
		}
		e.evict(context.Background())
		st := e.stats
		if reuse {
			if len(w.calls) != 1 || st.reusedWhileSaving == 0 || st.preemptedWithSaves != 1 || st.savesInFlightAtPreempt != 1 {
				t.Fatalf("evict calls %v, reused %d, preempted with saves %d (%d saves)", w.calls, st.reusedWhileSaving, st.preemptedWithSaves, st.savesInFlightAtPreempt)
			}
			for ref := range e.orphaned {
				if !slices.Contains(w.calls[0], dataplane.BlockRef{Group: ref.group, Block: ref.block}) {
					t.Fatalf("orphaned block %v reused but not evicted: %v", ref, w.calls[0])
				}
			}
			if len(e.pins) != 0 || len(e.orphans[k]) != 1 {
				t.Fatalf("pins %v orphans %v", e.pins, e.orphans)
			}
			e.saveReported(k)
			if len(e.orphans) != 0 || len(e.orphaned) != 0 {
				t.Fatalf("the report left orphans %v %v", e.orphans, e.orphaned)
			}
			continue
		}
		if st.reusedWhileSaving != 0 || len(e.pins[k]) != 1 {
			t.Fatalf("pinned: reused %d, pins %v", st.reusedWhileSaving, e.pins)
		}
		e.saveReported(k)
		if len(e.pins) != 0 {
			t.Fatalf("the report left pins %v", e.pins)
		}
	}
}

// TestPoolListsEvictedHeldBlocks: a block the worker may hold content in
// is listed as evicted when handed out again, once; a block never held is
// not.
func TestPoolListsEvictedHeldBlocks(t *testing.T) {
	p := newBlockPool(1, 3)
	a, _ := p.alloc(0)
	b, _ := p.alloc(0)
	p.hold(0, a)
	p.register(0, a, "ka")
	p.release(0, a)
	p.release(0, b)
	if got := p.takeEvicted(); len(got) != 0 {
		t.Fatalf("evicted %v before any reuse", got)
	}
	x, _ := p.alloc(0)
	y, _ := p.alloc(0)
	got := p.takeEvicted()
	if !slices.Equal(got, []blockRef{{0, a}}) || !slices.Contains([]kvcore.BlockID{x, y}, a) {
		t.Fatalf("evicted %v, want only the held block %d", got, a)
	}
	if _, ok := p.cached(0, "ka"); ok {
		t.Fatal("the reused block is still in the prefix cache")
	}
	if got := p.takeEvicted(); len(got) != 0 {
		t.Fatalf("evicted listed twice: %v", got)
	}
}
