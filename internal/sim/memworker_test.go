package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// memWorker is one rank's gpuworker in memory: GET /v1/pool, GET /metrics,
// and the data plane's write, read and evict. A block holds what was last
// written to it, with its hash; down makes every call answer 503 (a
// gpuworker gone).
type memWorker struct {
	m      *kvcore.Model
	engine string
	rank   kvcore.Rank
	url    string
	down   atomic.Bool

	mu      sync.Mutex
	blocks  map[dataplane.BlockRef]memBlock
	writes  int                        // write calls
	corrupt map[dataplane.BlockRef]int // reads serve this block with one byte flipped
	saved   float64                    // the save_put counter /metrics serves
}

type memBlock struct {
	hash string
	data []byte
}

// tpModel is the seed's model at tp ranks.
func tpModel(t *testing.T, tp int) *kvcore.Model {
	t.Helper()
	m := preset(t, "hybrid-mla-linear-tp8")
	m.Parallel.TP = tp
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	return m
}

// startMemWorkers starts one memWorker per worker rank of engine id.
func startMemWorkers(t *testing.T, m *kvcore.Model, id string) []*memWorker {
	t.Helper()
	var out []*memWorker
	for _, r := range m.WorkerRanks() {
		w := &memWorker{m: m, engine: id, rank: r, blocks: map[dataplane.BlockRef]memBlock{}, corrupt: map[dataplane.BlockRef]int{}}
		srv := httptest.NewServer(w)
		t.Cleanup(srv.Close)
		w.url = srv.URL
		out = append(out, w)
	}
	return out
}

func workerURLs(ws []*memWorker) []string {
	var out []string
	for _, w := range ws {
		out = append(out, w.url)
	}
	return out
}

// rankEngine is a test engine whose ranks are the workers, a rank dead
// once unreachable for rankTimeout.
func rankEngine(t *testing.T, m *kvcore.Model, ws []*memWorker, rankTimeout time.Duration) *engine {
	t.Helper()
	hooks := engineHooks{generated: func(*request) {}, abandoned: func(*request) {}, peerRead: func(string) {}, finalized: func(*request) {}}
	deps := engineDeps{model: m, ledger: newLedger(m, "run-", false), stats: newStats(), log: slog.New(slog.DiscardHandler),
		timeout: time.Minute, rankTimeout: rankTimeout, ranks: newRankWorkers(m, workerURLs(ws), http.DefaultClient)}
	return newEngine(ws[0].engine, RoleBoth, EngineConfig{PoolBlocks: 32, MaxBatchTokens: 64, MaxRunning: 4, Watermark: 1}, deps, hooks)
}

func (w *memWorker) ServeHTTP(rw http.ResponseWriter, req *http.Request) {
	if w.down.Load() {
		http.Error(rw, "down", http.StatusServiceUnavailable)
		return
	}
	switch req.URL.Path {
	case "/v1/pool":
		rw.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(rw).Encode(map[string]any{"engine_id": w.engine, "model": w.m.Name, "fingerprint": w.m.Fingerprint(),
			"rank": w.rank, "groups": []map[string]int{{"blocks": 64}, {"blocks": 48}}})
	case "/metrics":
		w.mu.Lock()
		fmt.Fprintf(rw, "# TYPE kvmesh_store_bytes_total counter\nkvmesh_store_bytes_total{op=\"save_put\"} %g\nkvmesh_store_bytes_total{op=\"load_get\"} 7\n", w.saved)
		w.mu.Unlock()
	case dataplane.PathWrite:
		w.write(rw, req)
	case dataplane.PathRead:
		w.read(rw, req)
	case dataplane.PathEvict:
		var er dataplane.EvictRequest
		if err := json.NewDecoder(req.Body).Decode(&er); err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		w.mu.Lock()
		for _, b := range er.Blocks {
			delete(w.blocks, b)
		}
		w.mu.Unlock()
		_ = json.NewEncoder(rw).Encode(dataplane.EvictResponse{Evicted: len(er.Blocks)})
	default:
		http.NotFound(rw, req)
	}
}

func (w *memWorker) write(rw http.ResponseWriter, req *http.Request) {
	for {
		h, err := dataplane.ReadFrameHeader(req.Body)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		data := make([]byte, h.Len)
		if err := dataplane.ReadFrameData(req.Body, h, data); err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		w.mu.Lock()
		w.blocks[h.Ref()] = memBlock{hash: h.Identity.Hash, data: data}
		w.mu.Unlock()
	}
	w.mu.Lock()
	w.writes++
	w.mu.Unlock()
	rw.WriteHeader(http.StatusNoContent)
}

func (w *memWorker) read(rw http.ResponseWriter, req *http.Request) {
	var rr dataplane.ReadRequest
	if err := json.NewDecoder(req.Body).Decode(&rr); err != nil {
		http.Error(rw, err.Error(), http.StatusBadRequest)
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []byte
	for _, ref := range rr.Blocks {
		b, ok := w.blocks[ref.BlockRef]
		if !ok || b.hash != ref.Hash {
			out = dataplane.AppendFrameHeader(out, dataplane.FrameHeader{Group: ref.Group, Block: ref.Block, NotHeld: true})
			continue
		}
		data := append([]byte(nil), b.data...)
		if w.corrupt[ref.BlockRef] > 0 {
			w.corrupt[ref.BlockRef]--
			data[0] ^= 0xff
		}
		out = dataplane.AppendFrameHeader(out, dataplane.FrameHeader{Group: ref.Group, Block: ref.Block, Len: len(data),
			Checksum: dataplane.Checksum(data), Identity: dataplane.Identity{Hash: ref.Hash}})
		out = append(out, data...)
	}
	rw.Header().Set("Content-Type", dataplane.ContentTypeFrames)
	_, _ = rw.Write(out)
}

// held returns the bytes the worker holds in a block, nil when none.
func (w *memWorker) held(group int, block kvcore.BlockID) []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.blocks[dataplane.BlockRef{Group: group, Block: block}].data
}
