package sim

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// restartedWorker is a gpuworker that restarted after a load: it holds the
// loaded blocks except the first asked (lost KV), and records writes.
type restartedWorker struct {
	m       *kvcore.Model
	mu      sync.Mutex
	written []dataplane.FrameHeader
}

func (w *restartedWorker) ServeHTTP(rw http.ResponseWriter, req *http.Request) {
	switch req.URL.Path {
	case dataplane.PathRead:
		var rr dataplane.ReadRequest
		if err := json.NewDecoder(req.Body).Decode(&rr); err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		var out []byte
		for i, ref := range rr.Blocks {
			h, _ := hex.DecodeString(ref.Hash)
			if i == 0 {
				out = dataplane.AppendFrameHeader(out, dataplane.FrameHeader{Group: ref.Group, Block: ref.Block, NotHeld: true})
				continue
			}
			data := BlockContent(w.m, ref.Group, kvcore.Rank{}, h)
			out = dataplane.AppendFrameHeader(out, dataplane.FrameHeader{Group: ref.Group, Block: ref.Block, Len: len(data),
				Checksum: dataplane.Checksum(data), Identity: dataplane.Identity{Hash: ref.Hash}})
			out = append(out, data...)
		}
		rw.Header().Set("Content-Type", dataplane.ContentTypeFrames)
		_, _ = rw.Write(out)
	case dataplane.PathWrite:
		for {
			h, err := dataplane.ReadFrameHeader(req.Body)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				http.Error(rw, err.Error(), http.StatusBadRequest)
				return
			}
			if err := dataplane.ReadFrameData(req.Body, h, make([]byte, h.Len)); err != nil {
				http.Error(rw, err.Error(), http.StatusBadRequest)
				return
			}
			w.mu.Lock()
			w.written = append(w.written, h)
			w.mu.Unlock()
		}
		rw.WriteHeader(http.StatusNoContent)
	default:
		http.NotFound(rw, req)
	}
}

// TestLoadedBlockLostIsRecomputed: a loaded block the worker no longer
// holds when read back is lost KV: recomputed (rewritten with its
// identity), not a mismatch, and the request does not fail.
func TestLoadedBlockLostIsRecomputed(t *testing.T) {
	e, _ := testEngine(t, "hybrid-mla-linear", 16)
	w := &restartedWorker{m: e.model}
	srv := httptest.NewServer(w)
	defer srv.Close()
	e.ranks = newRankWorkers(e.model, []string{srv.URL}, srv.Client())
	r := testRequest(e, "run-1", 40, 0)
	if !e.allocate(r, 40, 0, 32) {
		t.Fatal("allocate failed")
	}
	r.load = &expectedLoad{connector: "store", start: 0, end: 32, groups: e.model.LoadGroups(0, 32)}
	r.phase = phaseLoading
	if err := e.loaded(context.Background(), newOutbox(), r, contract.EngineFeedback{}); err != nil {
		t.Fatal(err)
	}
	st := e.stats
	if st.lostBlocks != 1 || st.mismatchedBlocks != 0 || r.failure != "" || st.recomputedTokens != 16 {
		t.Fatalf("lost %d, mismatched %d, recomputed %d tokens, failure %q", st.lostBlocks, st.mismatchedBlocks, st.recomputedTokens, r.failure)
	}
	if len(w.written) != 1 || w.written[0].Identity.Hash == "" || w.written[0].Identity.RequestID != "run-1" {
		t.Fatalf("rewrites %+v: want the lost block, with its identity", w.written)
	}
	if r.phase != phaseAllocated || r.computed != 32 {
		t.Fatalf("phase %v computed %d: the request goes on after its load", r.phase, r.computed)
	}
}
