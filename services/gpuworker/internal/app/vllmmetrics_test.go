package app_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// vllmCounts are the values of vLLM's store families for one operation and
// status on a worker's /metrics: operations, keys, bytes, failed keys.
type vllmCounts struct {
	calls, keys, bytes, failed float64
}

// vllmMetrics reads the worker's /metrics and returns the vLLM families'
// values of operation and status under the worker's model and engine; ok
// is false when the series does not exist.
func vllmMetrics(t *testing.T, w *worker, operation, status string) (c vllmCounts, ok bool) {
	t.Helper()
	fams, err := telemetry.ParseExposition([]byte(metricsText(t, w)))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct {
		name string
		into *float64
	}{
		{kvstore.VLLMMetricOperations, &c.calls}, {kvstore.VLLMMetricOperationKeys, &c.keys},
		{kvstore.VLLMMetricOperationBytes, &c.bytes}, {kvstore.VLLMMetricOperationFailedKeys, &c.failed},
	} {
		for _, m := range fams[f.name].GetMetric() {
			if telemetry.LabelValue(m, "model_name") == w.model.Name && telemetry.LabelValue(m, "engine") == w.cfg.EngineID &&
				telemetry.LabelValue(m, "operation") == operation && telemetry.LabelValue(m, "status") == status {
				*f.into, ok = m.GetCounter().GetValue(), true
			}
		}
	}
	return c, ok
}

// TestVLLMStoreFamiliesOfPutsAndLoads drives the gpuworker's save_put and
// load_get against a private redis-server — a load with two of three keys
// missing (partial_failure), a put (ok), and both again with the server
// stopped (error) — and reads vLLM's families back from /metrics, labelled
// with the worker's model and engine.
func TestVLLMStoreFamiliesOfPutsAndLoads(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	redis := testenv.StartRedis(t)
	cfg := testConfig(env, "engine-vllm")
	cfg.Model, cfg.PoolBlocks, cfg.RedisURL = "dense", 8, redis.URL()
	cfg.MaxBatchBytes = 16 << 20 // a load's three values in one Get
	cfg.StreamChunkBytes = 16 << 20
	w := startWorker(t, cfg, nil)
	rs := watchResults(t, env)
	ctx := context.Background()

	// From the start, every status of both operations is served at 0.
	for _, op := range []string{"save_put", "load_get"} {
		for _, status := range []string{kvstore.OpStatusOK, kvstore.OpStatusPartialFailure, kvstore.OpStatusError} {
			if c, ok := vllmMetrics(t, w, op, status); !ok || c != (vllmCounts{}) {
				t.Errorf("before any call: %s %s = %+v (served %v), want 0", op, status, c, ok)
			}
		}
	}

	hashes := hexChain(w.model, tokens(48, 300))
	value := dataplane.EncodeValue(w.model.Fingerprint(), w.randomBlock(0))
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 0, hashes[0]), value)
	task := w.loadTask(hashes, 48, kvcore.BlockTable{{5, 6, 7}})
	publishTask(t, publisher(t, env), task)
	rs.wait(t, task.TaskID)
	if c, _ := vllmMetrics(t, w, "load_get", kvstore.OpStatusPartialFailure); c != (vllmCounts{calls: 1, keys: 3, bytes: float64(len(value)), failed: 2}) {
		t.Errorf("load_get partial_failure = %+v, want 1 call of 3 keys, %d bytes, 2 failed", c, len(value))
	}

	key := w.keys.KeyHex(kvcore.Rank{}, 0, hashes[0])
	if err := redisClient(t, w.cfg.RedisURL).Del(ctx, key).Err(); err != nil { // values are written once: make room for the put
		t.Fatal(err)
	}
	put := []dataplane.PutItem{{BlockRef: dataplane.BlockRef{Group: 0, Block: 5}, Key: key, Hash: hashes[0]}}
	_, n, err := w.client.Put(ctx, put)
	if err != nil || n != int64(len(value)) {
		t.Fatalf("put = %d bytes, %v; want %d", n, err, len(value))
	}
	if c, _ := vllmMetrics(t, w, "save_put", kvstore.OpStatusOK); c != (vllmCounts{calls: 1, keys: 1, bytes: float64(n)}) {
		t.Errorf("save_put ok = %+v, want 1 call of 1 key, %d bytes", c, n)
	}

	redis.Stop()
	if _, _, err := w.client.Put(ctx, put); err == nil {
		t.Fatal("put with redis-server stopped succeeded")
	}
	if c, _ := vllmMetrics(t, w, "save_put", kvstore.OpStatusError); c.calls < 1 || c.failed != c.keys || c.bytes != c.calls*float64(n) {
		t.Errorf("save_put error = %+v, want every key failed and %d bytes sent per call", c, n)
	}
	task = w.loadTask(hashes, 48, kvcore.BlockTable{{5, 6, 7}})
	publishTask(t, publisher(t, env), task)
	deadline := time.Now().Add(waitFor)
	for last := (vllmCounts{}); ; {
		// Prometheus gathers the families concurrently, so one scrape
		// taken while the loader records a call can mix before and
		// after; two equal scrapes in a row are one consistent state.
		c, _ := vllmMetrics(t, w, "load_get", kvstore.OpStatusError)
		if c.calls >= 1 && c == last {
			if c.keys != 3*c.calls || c.failed != c.keys || c.bytes != 0 {
				t.Errorf("load_get error = %+v, want 3 keys per call, all failed, no bytes", c)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no settled load_get error recorded with redis-server stopped (last %+v):\n%s", c, metricsText(t, w))
		}
		last = c
		time.Sleep(50 * time.Millisecond) // poll interval of a deadline-bounded wait
	}
	if c, _ := vllmMetrics(t, w, "load_get", kvstore.OpStatusOK); c != (vllmCounts{}) {
		t.Errorf("load_get ok = %+v, want none", c)
	}
}
