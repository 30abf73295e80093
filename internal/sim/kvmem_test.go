package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
)

func TestKVMemoryOptions(t *testing.T) {
	for _, tc := range []struct {
		mode string
		ok   bool
	}{{KVMemoryAuto, true}, {KVMemoryHTTP, true}, {KVMemoryShm, true}, {"rdma", false}} {
		if err := checkKVMemory(tc.mode); (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrConfig) {
			t.Errorf("checkKVMemory(%q) = %v, want ok %v", tc.mode, err, tc.ok)
		}
	}
	for _, tc := range []struct {
		url   string
		local bool
	}{
		{"http://127.0.0.1:8084", true}, {"http://localhost:8084", true}, {"http://[::1]:8084", true},
		{"http://10.0.0.7:8084", false}, {"http://gpu-3.cluster:8084", false}, {"::bad", false},
	} {
		if got := loopback(tc.url); got != tc.local {
			t.Errorf("loopback(%q) = %v, want %v", tc.url, got, tc.local)
		}
	}
}

// kvmemSegments lists this process's segments left in the shared-memory
// directory.
func kvmemSegments(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(kvmem.ShmDir())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "kvmesh-") && strings.HasSuffix(e.Name(), ".kvmem") && strings.Contains(e.Name(), "-"+strconv.Itoa(os.Getpid())+"-") {
			out = append(out, e.Name())
		}
	}
	return out
}

// kvMemoryCalls counts the requests to the gpuworkers' kv-memory route,
// by method and worker host.
type kvMemoryCalls struct {
	next http.RoundTripper
	mu   sync.Mutex
	n    map[string]int // "GET host:port" → requests
}

func (c *kvMemoryCalls) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Path == kvmem.PathKVMemory {
		c.mu.Lock()
		c.n[req.Method+" "+req.URL.Host]++
		c.mu.Unlock()
	}
	return c.next.RoundTrip(req)
}

// count is the requests of method to the worker at base.
func (c *kvMemoryCalls) count(t *testing.T, method, base string) int {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[method+" "+u.Host]
}

// TestWorkerRestartReregisters plays a run with the engine's KV in
// shared memory, restarts one rank's gpuworker mid-run (SIGKILL, then a
// fresh process on the same address: its pool is its own heap again), and
// checks the simulator registered its segment with the new process, that
// the engines wrote nothing over HTTP, that nothing mismatched or was
// stored wrong, and that the run left no segment behind. The simulator
// finds the restart by the segment's liveness lock: it never asks the
// worker that stayed up whether its segment is still registered (GET
// /v1/kv-memory), and asks the restarted one only around its restart.
func TestWorkerRestartReregisters(t *testing.T) {
	cfg, m := simMeshOf(t, meshOptions{model: "hybrid-mla-linear-tp8", tp: 2, connectors: "store", poolBlocks: 96, engines: 1},
		tp2Workload(24), EngineConfig{PoolBlocks: 64, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	cfg.KVMemory, cfg.ProgressEvery = KVMemoryShm, 50*time.Millisecond
	calls := &kvMemoryCalls{next: dataplane.DefaultTransport(), n: map[string]int{}}
	cfg.HTTPClient = &http.Client{Transport: calls, Timeout: 30 * time.Second}
	defer cfg.HTTPClient.CloseIdleConnections()
	victim := m.Procs.Process(rankWorkerName("decode-0", 1))
	steady := m.Procs.Process(rankWorkerName("decode-0", 0))
	var once sync.Once
	restarted := make(chan error, 1)
	cfg.Progress = func(p Progress) {
		if p.Done >= 6 {
			once.Do(func() {
				if err := victim.Kill(); err != nil {
					restarted <- err
					return
				}
				restarted <- victim.Start()
			})
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	logReport(t, rep)
	select {
	case err := <-restarted:
		if err != nil {
			t.Fatalf("restart: %v", err)
		}
	default:
		t.Fatal("the run ended before the worker was restarted")
	}
	cur, err := kvmem.Current(ctx, withCredentials(http.DefaultClient, cfg.Credentials), victim.URL())
	if err != nil || cur.Kind != kvmem.KindShm || !strings.Contains(cur.Path, cfg.RunTag) {
		t.Fatalf("the restarted worker's memory: %+v, %v; want the run's segment registered again", cur, err)
	}
	if rep.Bytes.Computed == 0 || rep.Bytes.ComputedHTTP != 0 || len(rep.DeadRanks) != 0 {
		t.Fatalf("bytes %+v, dead ranks %+v: want every block written in shared memory and no dead rank", rep.Bytes, rep.DeadRanks)
	}
	for _, s := range rep.Ranks {
		if s.KVMemory != KVMemoryShm {
			t.Fatalf("rank %s wrote over %s", s.Name, s.KVMemory)
		}
	}
	if rep.Verification.Mismatched != 0 || rep.Stored == nil || rep.Stored.Wrong != 0 {
		t.Fatalf("verification %+v, stored %+v: a restart must not make bytes wrong", rep.Verification, rep.Stored)
	}
	if left := kvmemSegments(t); len(left) != 0 {
		t.Fatalf("the run left segments behind: %v", left)
	}
	gets, posts := calls.count(t, http.MethodGet, victim.URL()), calls.count(t, http.MethodPost, victim.URL())
	t.Logf("kv-memory calls: restarted worker GET %d POST %d; the other GET %d POST %d", gets, posts,
		calls.count(t, http.MethodGet, steady.URL()), calls.count(t, http.MethodPost, steady.URL()))
	if posts != 2 || gets == 0 {
		t.Fatalf("the restarted worker was asked %d times and registered with %d times: want asked after its restart and registered twice", gets, posts)
	}
	if n := calls.count(t, http.MethodGet, steady.URL()); n != 0 || calls.count(t, http.MethodPost, steady.URL()) != 1 {
		t.Fatalf("the worker that stayed up was asked for its kv memory %d times: want never (its lock says it maps the segment), registered once", n)
	}
}

// fakeKVMemoryWorker is a gpuworker's kv-memory route in this process: POST maps
// the segment with kvmem.Open (taking its liveness lock), GET answers it.
type fakeKVMemoryWorker struct {
	mu         sync.Mutex
	seg        *kvmem.Segment
	gets, post int
}

func (f *fakeKVMemoryWorker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	cur := kvmem.Registered{Kind: kvmem.KindHeap}
	switch r.Method {
	case http.MethodGet:
		f.gets++
	case http.MethodPost:
		f.post++
		var reg kvmem.Registration
		if err := json.NewDecoder(r.Body).Decode(&reg); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		seg, err := kvmem.Open(reg.Path, reg.Layout)
		if err != nil {
			http.Error(w, err.Error(), http.StatusConflict)
			return
		}
		f.restart()
		f.seg = seg
	}
	if f.seg != nil {
		cur = kvmem.Registered{Kind: kvmem.KindShm, Path: f.seg.Path(), Layout: f.seg.Layout()}
	}
	_ = json.NewEncoder(w).Encode(cur)
}

// restart drops the segment, as a restarted worker (f.mu held).
func (f *fakeKVMemoryWorker) restart() {
	if f.seg != nil {
		_ = f.seg.Close()
		f.seg = nil
	}
}

// calls is the GETs and POSTs the worker served.
func (f *fakeKVMemoryWorker) calls() (gets, posts int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gets, f.post
}

// TestEnsureAsksOnlyWhenUnmapped: ensure registers a segment nobody maps,
// then, while the worker holds it (its lock), asks the worker nothing;
// once the worker dropped it (a restart), ensure asks and registers again,
// clearing the records the dead worker left mid-load first.
func TestEnsureAsksOnlyWhenUnmapped(t *testing.T) {
	worker := &fakeKVMemoryWorker{}
	srv := httptest.NewServer(worker)
	defer srv.Close()
	l := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 4, Regions: []int64{64}}}}
	path := filepath.Join(kvmem.ShmDir(), fmt.Sprintf("kvmesh-ensure-test-%d.kvmem", os.Getpid()))
	seg, err := kvmem.Create(path, l)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Remove()
	defer func() { worker.mu.Lock(); worker.restart(); worker.mu.Unlock() }()
	m := &rankMemory{seg: seg, w: kvmem.NewEngineWriter(seg), reg: kvmem.Registration{Kind: kvmem.KindShm, Path: path, Layout: l}}
	ctx := context.Background()
	want := func(what string, gets, posts int) {
		t.Helper()
		if g, p := worker.calls(); g != gets || p != posts {
			t.Fatalf("%s: the worker served %d GETs and %d POSTs, want %d and %d", what, g, p, gets, posts)
		}
	}
	if err := m.ensure(ctx, srv.Client(), srv.URL); err != nil {
		t.Fatal(err)
	}
	want("first ensure", 1, 1)
	for range 50 {
		if err := m.ensure(ctx, srv.Client(), srv.URL); err != nil {
			t.Fatal(err)
		}
	}
	want("ensure while the worker maps the segment", 1, 1)
	// The worker dies mid-load: a record left odd, then its lock goes.
	worker.mu.Lock()
	if _, err := worker.seg.Record(0, 2).Begin(kvmem.WriterWorker); err != nil {
		t.Fatal(err)
	}
	worker.restart()
	worker.mu.Unlock()
	if err := m.ensure(ctx, srv.Client(), srv.URL); err != nil {
		t.Fatal(err)
	}
	want("ensure after the worker's restart", 2, 2)
	if _, _, ok := seg.Record(0, 2).Load(); !ok {
		t.Fatal("the record the dead worker left mid-write is still odd after the re-registration")
	}
	if err := m.ensure(ctx, srv.Client(), srv.URL); err != nil {
		t.Fatal(err)
	}
	want("ensure after the re-registration", 2, 2)
}

// TestContentFilledInPlace: content computed straight into a block's
// regions (the engine's KV memory) is exactly the content the data plane
// path computes into a buffer, whatever the region boundaries.
func TestContentFilledInPlace(t *testing.T) {
	m := preset(t, "hybrid-mla-linear")
	c := newContents(m)
	h := kvcore.HashTokens(nil, []uint32{5, 6, 7}, nil)
	want := c.nsBlock(1, kvcore.Rank{}, h)
	for _, cuts := range [][]int64{{int64(len(want))}, {1, 7, int64(len(want)) - 8}, {4096, int64(len(want)) - 4096}} {
		buf := make([]byte, len(want))
		c.nsFill(kvmem.Split(buf, cuts), 1, kvcore.Rank{}, h)
		if !bytes.Equal(buf, want) {
			t.Fatalf("regions %v: the content filled in place differs", cuts)
		}
	}
}
