package app_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// bytesPerItem is what the gated worker reports storing per item.
const bytesPerItem = 10

// gatedWorker is a fake gpuworker data plane whose puts wait until a given
// number of them are in flight at once (or a deadline passes), so a test
// can prove the sender overlaps tasks. It answers every item stored.
type gatedWorker struct {
	want int // puts in flight that open the gate

	mu       sync.Mutex
	inFlight int
	most     int
	open     chan struct{}
	opened   sync.Once
	// perRequest counts the puts in flight per request id; overlaps counts
	// puts that arrived while another of their request was in flight.
	perRequest map[string]int
	overlaps   int
	// keys lists the first key of each put, per request, in arrival order.
	keys map[string][]string
}

func newGatedWorker(want int) *gatedWorker {
	return &gatedWorker{want: want, open: make(chan struct{}), perRequest: map[string]int{}, keys: map[string][]string{}}
}

func (w *gatedWorker) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	if r.URL.Path != dataplane.PathPut {
		http.NotFound(rw, r)
		return
	}
	var req dataplane.PutRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || len(req.Items) == 0 {
		http.Error(rw, "bad put", http.StatusBadRequest)
		return
	}
	id := req.Items[0].RequestID
	w.mu.Lock()
	w.inFlight++
	w.perRequest[id]++
	if w.perRequest[id] > 1 {
		w.overlaps++
	}
	w.keys[id] = append(w.keys[id], req.Items[0].Key)
	if w.inFlight > w.most {
		w.most = w.inFlight
		if w.most == w.want {
			w.opened.Do(func() { close(w.open) })
		}
	}
	w.mu.Unlock()
	select {
	case <-w.open:
	case <-r.Context().Done():
	case <-time.After(5 * time.Second): // under the harness's 10 s put timeout
		// Too few puts overlap (the test fails on w.most): let the others
		// through at once.
		w.opened.Do(func() { close(w.open) })
	}
	w.mu.Lock()
	w.inFlight--
	w.perRequest[id]--
	w.mu.Unlock()
	res := dataplane.PutResponse{Results: make([]dataplane.PutResult, len(req.Items)), Bytes: int64(bytesPerItem * len(req.Items))}
	for i := range res.Results {
		res.Results[i].Status = dataplane.PutStored
	}
	rw.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(rw).Encode(res)
}

// TestConcurrentSavesOverlapAndCompleteOnce runs the sender with 8 lanes
// against a worker whose puts wait until 4 are in flight at once: the
// saves of different requests must overlap for any to finish. Each request
// has two tasks (tokens [0,32) and [32,64)); they must be put one after the
// other, in order, and every task must end with exactly one outcome and
// one result, all stored. The model is TP1, so each task is one put (with
// several ranks a task's puts overlap by design).
func TestConcurrentSavesOverlapAndCompleteOnce(t *testing.T) {
	const requests, lanes, gate = 12, 8, 4
	s := newStack(t, stackOptions{config: func(c *app.Config) { c.Concurrency = lanes }})
	w := newGatedWorker(gate)
	srv := httptest.NewServer(w)
	t.Cleanup(srv.Close)
	const engine = "gated"
	for _, r := range s.model.WorkerRanks() { // the ranks that put: one at TP1
		if err := registry.Register(context.Background(), s.db, registry.Worker{EngineID: engine, Rank: r, Addr: srv.URL}); err != nil {
			t.Fatal(err)
		}
	}

	var tasks []*kvcore.SaveTask
	firstKeys := map[string][]string{} // request → first key of its tasks' puts, in order
	for i := range requests {
		id := "conc-" + strconv.Itoa(i)
		tokens := tokensFor(s.prefix+id, 64)
		for _, span := range [][2]int{{0, 32}, {32, 64}} {
			task := s.taskWithTokens(t, engine, id, tokens, span[0], span[1], 0)
			tasks = append(tasks, task)
			firstKeys[id] = append(firstKeys[id], s.plannedKeys(t, task)[0])
		}
	}
	s.publish(t, tasks...)

	for _, task := range tasks {
		res := s.got.result(t, task.TaskID)
		keys := s.plannedKeys(t, task)
		stored := 0
		for _, g := range res.Groups {
			stored += g.Stored
		}
		if res.Status != "stored" || stored != len(keys) || res.Bytes != int64(bytesPerItem*len(keys)) {
			t.Errorf("task %s: result %+v, want %d keys stored (%d bytes)", task.TaskID, res, len(keys), bytesPerItem*len(keys))
		}
	}
	poll(t, "every outcome", func() bool { return s.outcomes(t) == len(tasks) })

	var dup int
	if err := s.db.QueryRow(context.Background(),
		"SELECT count(*) - count(DISTINCT task_id) FROM save_outcomes").Scan(&dup); err != nil || dup != 0 {
		t.Errorf("save_outcomes holds %d duplicate rows (%v)", dup, err)
	}
	s.got.mu.Lock()
	results := map[string]int{}
	for _, r := range s.got.results {
		results[r.TaskID]++
	}
	s.got.mu.Unlock()
	for _, task := range tasks {
		if results[task.TaskID] != 1 {
			t.Errorf("task %s has %d results, want 1", task.TaskID, results[task.TaskID])
		}
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	if w.most < gate || w.most > lanes {
		t.Errorf("at most %d puts were in flight at once, want between %d and %d", w.most, gate, lanes)
	}
	if w.overlaps != 0 {
		t.Errorf("%d puts overlapped another put of their request", w.overlaps)
	}
	for id, want := range firstKeys {
		if got := w.keys[id]; !slices.Equal(got, want) {
			t.Errorf("request %s: puts began with keys %v, want %v (its tasks in order, once each)", id, got, want)
		}
	}
}

// plannedKeys lists the store keys the sender puts for task, by worker
// rank (the order of its put requests at TP1; at larger sizes the ranks'
// puts run at once), each rank's groups in order.
func (s *stack) plannedKeys(t testing.TB, task *kvcore.SaveTask) []string {
	t.Helper()
	kb := kvcore.KeysOf(s.model).WithPrefix(s.prefix)
	var ranks []kvcore.Rank
	byRank := map[kvcore.Rank][]string{}
	for _, gc := range task.Groups {
		for _, r := range s.model.WorkerRanks() {
			items, err := kvcore.PlanSend(s.model, kb, task, gc.Group, r)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := byRank[r]; !ok {
				ranks = append(ranks, r)
			}
			for _, it := range items {
				byRank[r] = append(byRank[r], it.Key)
			}
		}
	}
	var out []string
	for _, r := range ranks {
		out = append(out, byRank[r]...)
	}
	return out
}
