package sim

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

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

// TestWorkerRestartReregisters plays a run with the engine's KV in
// shared memory, restarts one rank's gpuworker mid-run (SIGKILL, then a
// fresh process on the same address: its pool is its own heap again), and
// checks the simulator registered its segment with the new process, that
// the engines wrote nothing over HTTP, that nothing mismatched or was
// stored wrong, and that the run left no segment behind.
func TestWorkerRestartReregisters(t *testing.T) {
	cfg, m := simMeshOf(t, meshOptions{model: "hybrid-mla-linear-tp8", tp: 2, connectors: "store", poolBlocks: 96, engines: 1},
		tp2Workload(24), EngineConfig{PoolBlocks: 64, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	cfg.KVMemory, cfg.ProgressEvery = KVMemoryShm, 50*time.Millisecond
	victim := m.Procs.Process(rankWorkerName("decode-0", 1))
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
