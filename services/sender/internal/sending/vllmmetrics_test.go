package sending_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// vllmValue is the value of family's series for the sender's save_exists
// of engine with status in reg; 0 when the series does not exist.
func vllmValue(t *testing.T, reg *prometheus.Registry, family, model, engine, status string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"model_name": model, "engine": engine, "operation": "save_exists", "status": status}
	for _, f := range families {
		if f.GetName() != family {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if want[l.GetName()] != l.GetValue() {
					continue series
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestSaveExistsInVLLMFamilies handles a save task whose existence check
// reaches a real redis-server (save_exists ok, under the task's engine),
// then one after the server stopped (save_exists error on every attempt,
// every key failed), and reads vLLM's families back.
func TestSaveExistsInVLLMFamilies(t *testing.T) {
	srv := testenv.StartRedis(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := kvstore.NewRedis(ctx, srv.URL(), kvstore.RedisOptions{MaxRetries: -1, DialAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rs.Close() })
	reg := prometheus.NewRegistry()
	sm, err := kvstore.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m := mustModel(t)
	// As the sender's app wires it: the model for every call, the engine per task.
	store := kvstore.Instrument(rs, sm, kvstore.OpNames{Exists: "save_exists"}).WithLabels(kvstore.VLLMLabels{ModelName: m.Name})
	f := newFixture(t, dbtest.NewPool(t), store)

	task := saveTask(f.model, "vllm-ok", 0, 32, 0)
	f.handle(t, encode(t, task))
	if res, _ := f.outcome(t, task.TaskID); res.Status != "stored" {
		t.Fatalf("result %+v, want stored", res)
	}
	keys := 0.0
	for g := range f.model.Groups {
		keys += float64(len(f.keysOf(t, task, g)))
	}
	srv.Stop()
	failing := saveTask(f.model, "vllm-error", 0, 32, 8)
	f.handle(t, encode(t, failing))
	if res, _ := f.outcome(t, failing.TaskID); res.Status != "dead_lettered" {
		t.Fatalf("result %+v with redis-server stopped, want dead_lettered (exists_failed)", res)
	}

	const attempts = 3 // the fixture's RetryPolicy.MaxAttempts
	cases := []struct {
		family, engine, status string
		want                   float64
	}{
		{kvstore.VLLMMetricOperations, task.EngineID, kvstore.OpStatusOK, 1},
		{kvstore.VLLMMetricOperationKeys, task.EngineID, kvstore.OpStatusOK, keys},
		{kvstore.VLLMMetricOperationFailedKeys, task.EngineID, kvstore.OpStatusOK, 0},
		{kvstore.VLLMMetricOperations, task.EngineID, kvstore.OpStatusError, attempts},
		{kvstore.VLLMMetricOperationKeys, task.EngineID, kvstore.OpStatusError, attempts * keys},
		{kvstore.VLLMMetricOperationFailedKeys, task.EngineID, kvstore.OpStatusError, attempts * keys},
		{kvstore.VLLMMetricOperations, "", kvstore.OpStatusOK, 0}, // no call without its engine
	}
	for _, tc := range cases {
		if got := vllmValue(t, reg, tc.family, m.Name, tc.engine, tc.status); got != tc.want {
			t.Errorf("%s{engine=%q,status=%q} = %v, want %v", tc.family, tc.engine, tc.status, got, tc.want)
		}
	}
	if keys == 0 {
		t.Fatal("the task planned no keys")
	}
}
