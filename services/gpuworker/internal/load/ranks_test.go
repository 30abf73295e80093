package load_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/load"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// published collects what a loader publishes.
type published struct {
	mu   sync.Mutex
	msgs []bus.Message
}

func (p *published) Publish(_ context.Context, msgs ...bus.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

// results decodes every published transfer result.
func (p *published) results(t *testing.T) []contract.TransferResult {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []contract.TransferResult
	for _, m := range p.msgs {
		var r contract.TransferResult
		if err := json.Unmarshal(m.Value, &r); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

// rankLoader is a loader of engine "e" at rank r of the hybrid-mla-linear
// preset at size tp, over an in-memory store holding every chunk of r's
// namespaces for a 32-token prompt, and the load task of that prompt.
func rankLoader(t *testing.T, tp int, r kvcore.Rank) (*load.Loader, *published, *kvcore.LoadTask) {
	t.Helper()
	l, pub, task, _ := rankLoaderAged(t, tp, r, 0)
	return l, pub, task
}

// rankLoaderAged is rankLoader refusing tasks older than maxAge, and its
// pool.
func rankLoaderAged(t *testing.T, tp int, r kvcore.Rank, maxAge time.Duration) (*load.Loader, *published, *kvcore.LoadTask, *pool.Pool) {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	m.Parallel.TP = tp
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(m, 8)
	if err != nil {
		t.Fatal(err)
	}
	met, err := metrics.New(prometheus.NewRegistry(), func() []pool.GroupStats { return p.Stats(m) }, nil)
	if err != nil {
		t.Fatal(err)
	}
	kb := kvcore.KeysOf(m)
	var hashes []string
	toks := make([]uint32, 32)
	for i := range toks {
		toks[i] = uint32(7000 + i)
	}
	for _, h := range kvcore.HashChain(toks, m.HashBlockSize, nil) {
		hashes = append(hashes, h.Hex())
	}
	task := &kvcore.LoadTask{
		Schema: kvcore.SchemaLoadTask, TaskID: "task-ranks", EngineID: "e", RequestID: "req-ranks",
		Model: m.Name, Connector: "store", Start: 0, End: 32, BlockHashes: hashes,
		BlockTable: kvcore.BlockTable{{1, 2}, {kvcore.NullBlock, 3}}, Groups: m.LoadGroups(0, 32),
	}
	store := kvstore.NewMemory(kvstore.MemoryOptions{})
	t.Cleanup(func() { _ = store.Close() })
	items, err := kvcore.PlanLoad(m, kb, task, r)
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range items {
		v := dataplane.EncodeValue(m.Fingerprint(), make([]byte, m.Groups[it.Group].BytesPerBlock))
		if _, err := store.Put(context.Background(), []kvstore.Item{{Key: it.Key, Value: v}}); err != nil {
			t.Fatal(err)
		}
	}
	pub := &published{}
	l := load.New(load.Config{
		Model: m, Keys: kb, EngineID: "e", Rank: r, Pool: p, Store: store, Publisher: pub,
		MaxBatchBytes: 1 << 20, Metrics: met, Log: slog.New(slog.DiscardHandler), MaxAge: maxAge,
	})
	return l, pub, task, p
}

// handle runs task through the loader's bus handler.
func handle(t *testing.T, l *load.Loader, task *kvcore.LoadTask) {
	t.Helper()
	handleAt(t, l, task, time.Time{})
}

// handleAt runs task through the handler as a record of time at.
func handleAt(t *testing.T, l *load.Loader, task *kvcore.LoadTask, at time.Time) {
	t.Helper()
	v, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Handle(context.Background(), bus.Received{Message: bus.Message{
		Topic: contract.TopicLoadTasks, Key: task.EngineID, Value: v}, Time: at}); err != nil {
		t.Fatalf("Handle: %v", err)
	}
}

// TestStaleLoadTaskIsRefused: a task older than the loader's MaxAge
// (history a new rank's group reads from the topic's beginning, a
// redelivery long after the scheduler gave up) loads nothing and reports
// every block it lists as a load error; a recent one is loaded.
func TestStaleLoadTaskIsRefused(t *testing.T) {
	l, pub, task, p := rankLoaderAged(t, 2, kvcore.Rank{TP: 1}, time.Minute)
	handleAt(t, l, task, time.Now().Add(-2*time.Minute))
	got := pub.results(t)
	if len(got) != 1 || got[0].Bytes != 0 || !slices.Equal(got[0].LoadErrors, []kvcore.BlockID{1, 2, 3}) {
		t.Fatalf("stale task: results %+v, want one with every listed block [1 2 3] in error and no bytes", got)
	}
	for g := range 2 {
		for _, b := range []kvcore.BlockID{1, 2, 3} {
			if tag, err := p.Tag(g, b); err != nil || tag.Hash != "" {
				t.Fatalf("stale task wrote group %d block %d (%+v, %v)", g, b, tag, err)
			}
		}
	}
	handleAt(t, l, task, time.Now().Add(-time.Second))
	if got = pub.results(t); len(got) != 2 || len(got[1].LoadErrors) != 0 || got[1].Bytes == 0 {
		t.Fatalf("fresh task: results %+v, want a clean load", got)
	}
}

// TestLoadResultNamesTheRank: on a multi-rank engine (or for a task that
// lists Ranks) the result names the worker's rank and has its own result
// id; a single-rank engine's task without Ranks names none, as before.
func TestLoadResultNamesTheRank(t *testing.T) {
	tp1 := kvcore.Rank{TP: 1}
	tests := []struct {
		name     string
		tp       int
		rank     kvcore.Rank
		ranks    []kvcore.Rank
		wantRank *kvcore.Rank
	}{
		{"TP2, the task lists both ranks", 2, tp1, []kvcore.Rank{{}, tp1}, &tp1},
		{"TP2, a task without Ranks is still loaded and names the rank", 2, tp1, nil, &tp1},
		{"TP1, a task without Ranks names no rank", 1, kvcore.Rank{}, nil, nil},
		{"TP1, a task listing rank 0 names it", 1, kvcore.Rank{}, []kvcore.Rank{{}}, &kvcore.Rank{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l, pub, task := rankLoader(t, tc.tp, tc.rank)
			task.Ranks = tc.ranks
			handle(t, l, task)
			got := pub.results(t)
			if len(got) != 1 {
				t.Fatalf("%d results, want 1", len(got))
			}
			r := got[0]
			if (r.Rank == nil) != (tc.wantRank == nil) || (r.Rank != nil && *r.Rank != *tc.wantRank) {
				t.Fatalf("result rank %v, want %v", r.Rank, tc.wantRank)
			}
			if r.ResultID != load.ResultID(task.TaskID, tc.rank) || len(r.LoadErrors) != 0 || r.Bytes == 0 {
				t.Fatalf("result %+v, want a clean load with result id %s", r, load.ResultID(task.TaskID, tc.rank))
			}
		})
	}
	if load.ResultID("t", kvcore.Rank{}) == load.ResultID("t", tp1) {
		t.Fatal("two ranks' loads of one task share a result id")
	}
}

// TestLoadTaskOfOtherRanksIsSkipped: a worker whose rank is not among a
// task's Ranks neither loads it nor publishes a result.
func TestLoadTaskOfOtherRanksIsSkipped(t *testing.T) {
	l, pub, task := rankLoader(t, 4, kvcore.Rank{TP: 3})
	task.Ranks = []kvcore.Rank{{TP: 0}, {TP: 1}, {TP: 2}}
	if l.Assigned(task) {
		t.Fatal("Assigned: rank tp3 is not one of the task's ranks")
	}
	handle(t, l, task)
	if got := pub.results(t); len(got) != 0 {
		t.Fatalf("a skipped task published %+v", got)
	}
	task.Ranks = append(task.Ranks, kvcore.Rank{TP: 3})
	handle(t, l, task)
	if got := pub.results(t); len(got) != 1 || got[0].Rank == nil || *got[0].Rank != (kvcore.Rank{TP: 3}) {
		t.Fatalf("results %+v, want one naming rank tp3", got)
	}
}
