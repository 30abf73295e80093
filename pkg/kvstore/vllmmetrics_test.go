package kvstore_test

import (
	"context"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// vllmSeries is what one series set of the vLLM families holds: the
// operation count (and the histogram's sample count, which must equal it),
// keys, bytes and failed keys.
type vllmSeries struct {
	calls, keys, bytes, failed float64
}

// scrapeVLLM serves reg's /metrics over HTTP, reads it back and returns
// the raw body and the vLLM families' values for each series set, keyed
// by "model_name/engine/operation/status". It fails the test when the
// histogram's sample count of a series set differs from its operation
// count, or its buckets from vLLM's.
func scrapeVLLM(t *testing.T, reg *prometheus.Registry) (string, map[string]vllmSeries) {
	t.Helper()
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s, %v", resp.Status, err)
	}
	fams, err := telemetry.ParseExposition(body)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]vllmSeries{}
	each := func(name string, f func(m *dto.Metric, s *vllmSeries)) {
		for _, m := range fams[name].GetMetric() {
			k := strings.Join([]string{telemetry.LabelValue(m, "model_name"), telemetry.LabelValue(m, "engine"),
				telemetry.LabelValue(m, "operation"), telemetry.LabelValue(m, "status")}, "/")
			s := out[k]
			f(m, &s)
			out[k] = s
		}
	}
	each(kvstore.VLLMMetricOperations, func(m *dto.Metric, s *vllmSeries) { s.calls = m.GetCounter().GetValue() })
	each(kvstore.VLLMMetricOperationKeys, func(m *dto.Metric, s *vllmSeries) { s.keys = m.GetCounter().GetValue() })
	each(kvstore.VLLMMetricOperationBytes, func(m *dto.Metric, s *vllmSeries) { s.bytes = m.GetCounter().GetValue() })
	each(kvstore.VLLMMetricOperationFailedKeys, func(m *dto.Metric, s *vllmSeries) { s.failed = m.GetCounter().GetValue() })
	// vLLM's buckets, and the +Inf one that the exposition adds.
	wantBuckets := []float64{0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 4, math.Inf(1)}
	each(kvstore.VLLMMetricOperationTime, func(m *dto.Metric, s *vllmSeries) {
		h := m.GetHistogram()
		var bounds []float64
		for _, b := range h.GetBucket() {
			bounds = append(bounds, b.GetUpperBound())
		}
		if !slices.Equal(bounds, wantBuckets) {
			t.Errorf("%s%v buckets %v, want vLLM's %v", kvstore.VLLMMetricOperationTime, m.GetLabel(), bounds, wantBuckets)
		}
		if float64(h.GetSampleCount()) != s.calls {
			t.Errorf("%s%v counts %d calls, %s %v", kvstore.VLLMMetricOperationTime, m.GetLabel(), h.GetSampleCount(), kvstore.VLLMMetricOperations, s.calls)
		}
	})
	return string(body), out
}

// TestVLLMFamiliesAgainstRedis drives each operation kvmesh records under
// vLLM's names (save_exists, save_put, load_get, lookup_exists) through
// Instrumented wrappers over a real redis-server, first while it answers
// (ok, and partial_failure for a Put of a value over the size limit and a
// Get of a missing key) and then after it stopped (error), and reads the
// counts, keys, bytes, failed keys and status labels back from /metrics.
func TestVLLMFamiliesAgainstRedis(t *testing.T) {
	srv := testenv.StartRedis(t)
	ctx := context.Background()
	store := newRedis(t, srv.URL(), kvstore.RedisOptions{MaxValueBytes: 8, DialTimeout: time.Second, MaxRetries: -1, DialAttempts: 1})
	reg := prometheus.NewRegistry()
	m, err := kvstore.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	const model = "hybrid-mla-linear"
	// The sender and lookup serve every engine: the engine comes with each
	// call's context. A gpuworker serves one: its wrapper names it.
	sender := kvstore.Instrument(store, m, kvstore.OpNames{Exists: "save_exists"}).WithLabels(kvstore.VLLMLabels{ModelName: model})
	lookup := kvstore.Instrument(store, m, kvstore.OpNames{Exists: "lookup_exists"}).WithLabels(kvstore.VLLMLabels{ModelName: model})
	worker := kvstore.Instrument(store, m, kvstore.OpNames{Put: "save_put", Get: "load_get"}).
		WithLabels(kvstore.VLLMLabels{ModelName: model, Engine: "prefill-0"})
	decode := kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: "decode-0"})
	prefill := kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: "prefill-0"})

	// Before any call the gpuworker's series exist at 0, for every status.
	_, before := scrapeVLLM(t, reg)
	for _, k := range []string{model + "/prefill-0/save_put/ok", model + "/prefill-0/save_put/partial_failure",
		model + "/prefill-0/save_put/error", model + "/prefill-0/load_get/error"} {
		if s, ok := before[k]; !ok || s != (vllmSeries{}) {
			t.Errorf("before any call: series %s = %+v (present %v), want all 0", k, s, ok)
		}
	}

	keys := testKeys(t, store, 4)
	steps := []struct {
		name string
		call func() error
	}{
		{"save_put ok", func() error { // 3 + 4 bytes
			errs, err := worker.Put(ctx, []kvstore.Item{{Key: keys[0], Value: []byte("abc")}, {Key: keys[1], Value: []byte("defg")}})
			return firstErr(err, errs...)
		}},
		{"save_put partial_failure", func() error { // 2 + 9 bytes, the 9 over the limit
			errs, err := worker.Put(ctx, []kvstore.Item{{Key: keys[2], Value: []byte("hi")}, {Key: keys[3], Value: []byte("too large")}})
			if err != nil || errs[0] != nil || errs[1] == nil {
				return firstErr(err, errs...)
			}
			return nil
		}},
		{"save_exists ok", func() error { // 3 keys, one absent: still ok
			_, err := sender.Exists(decode, keys[:3])
			return err
		}},
		{"save_exists ok again", func() error {
			_, err := sender.Exists(decode, keys[3:])
			return err
		}},
		{"lookup_exists ok", func() error {
			_, err := lookup.Exists(prefill, keys)
			return err
		}},
		{"load_get ok", func() error { // 3 + 4 bytes
			_, errs, err := worker.Get(ctx, keys[:2])
			return firstErr(err, errs...)
		}},
		{"load_get partial_failure", func() error { // keys[3] was never stored
			_, errs, err := worker.Get(ctx, []string{keys[2], keys[3], keys[0]})
			if err != nil || errs[1] == nil {
				return firstErr(err, errs...)
			}
			return nil
		}},
	}
	for _, st := range steps {
		if err := st.call(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
	}

	// An engine's first call of an operation created its series of every
	// status, so that rate() sees the first failure.
	_, during := scrapeVLLM(t, reg)
	for _, k := range []string{model + "/decode-0/save_exists/error", model + "/prefill-0/lookup_exists/error"} {
		if s, ok := during[k]; !ok || s != (vllmSeries{}) {
			t.Errorf("before any failure: series %s = %+v (present %v), want all 0", k, s, ok)
		}
	}

	srv.Stop()
	outage := []struct {
		name string
		call func() error
	}{
		{"save_exists", func() error { _, err := sender.Exists(decode, keys[:3]); return err }},
		{"lookup_exists", func() error { _, err := lookup.Exists(prefill, keys); return err }},
		{"save_put", func() error { // 5 bytes sent, none stored
			_, err := worker.Put(ctx, []kvstore.Item{{Key: keys[0], Value: []byte("again")}})
			return err
		}},
		{"load_get", func() error { _, _, err := worker.Get(ctx, keys[:2]); return err }},
	}
	for _, st := range outage {
		if err := st.call(); err == nil {
			t.Fatalf("%s with redis-server stopped succeeded", st.name)
		}
	}

	body, got := scrapeVLLM(t, reg)
	want := map[string]vllmSeries{
		model + "/decode-0/save_exists/ok":            {calls: 2, keys: 4},
		model + "/decode-0/save_exists/error":         {calls: 1, keys: 3, failed: 3},
		model + "/prefill-0/lookup_exists/ok":         {calls: 1, keys: 4},
		model + "/prefill-0/lookup_exists/error":      {calls: 1, keys: 4, failed: 4},
		model + "/prefill-0/save_put/ok":              {calls: 1, keys: 2, bytes: 7},
		model + "/prefill-0/save_put/partial_failure": {calls: 1, keys: 2, bytes: 11, failed: 1},
		model + "/prefill-0/save_put/error":           {calls: 1, keys: 1, bytes: 5, failed: 1},
		model + "/prefill-0/load_get/ok":              {calls: 1, keys: 2, bytes: 7},
		model + "/prefill-0/load_get/partial_failure": {calls: 1, keys: 3, bytes: 5, failed: 1},
		model + "/prefill-0/load_get/error":           {calls: 1, keys: 2, failed: 2},
	}
	for k, w := range want {
		if g, ok := got[k]; !ok || g != w {
			t.Errorf("series %s = %+v (present %v), want %+v", k, g, ok, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok && g != (vllmSeries{}) {
			t.Errorf("unexpected non-zero series %s = %+v", k, g)
		}
	}
	// vLLM's names, colon included, are served as plain metric names, not
	// as quoted UTF-8 names.
	for _, name := range []string{kvstore.VLLMMetricOperations, kvstore.VLLMMetricOperationKeys, kvstore.VLLMMetricOperationBytes,
		kvstore.VLLMMetricOperationFailedKeys, kvstore.VLLMMetricOperationTime + "_bucket"} {
		if !strings.Contains(body, "\n"+name+"{") {
			t.Errorf("/metrics has no series line starting %s{", name)
		}
	}
	// kvmesh's own families keep counting the same calls.
	if v := metricValue(t, reg, kvstore.MetricKeys, map[string]string{"op": "save_exists"}); v != 7 {
		t.Errorf("%s{op=save_exists} = %v, want 7", kvstore.MetricKeys, v)
	}
}

// firstErr returns err, or else the first non-nil per-key error.
func firstErr(err error, errs ...error) error {
	if err != nil {
		return err
	}
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func TestVLLMLabelsOfContextOverrideTheWrappers(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := kvstore.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	s := kvstore.Instrument(kvstore.NewMemory(kvstore.MemoryOptions{}), m, kvstore.OpNames{Exists: "lookup_exists"}).
		WithLabels(kvstore.VLLMLabels{ModelName: "m", Engine: "default-engine"})
	cases := []struct {
		name   string
		ctx    context.Context
		labels map[string]string
	}{
		{"no labels in context", context.Background(), map[string]string{"model_name": "m", "engine": "default-engine"}},
		{"engine in context", kvstore.WithVLLMLabels(context.Background(), kvstore.VLLMLabels{Engine: "e1"}),
			map[string]string{"model_name": "m", "engine": "e1"}},
		{"both in context", kvstore.WithVLLMLabels(context.Background(), kvstore.VLLMLabels{ModelName: "m2", Engine: "e2"}),
			map[string]string{"model_name": "m2", "engine": "e2"}},
		{"nested: the inner engine, the outer model", kvstore.WithVLLMLabels(
			kvstore.WithVLLMLabels(context.Background(), kvstore.VLLMLabels{ModelName: "m3", Engine: "outer"}),
			kvstore.VLLMLabels{Engine: "inner"}), map[string]string{"model_name": "m3", "engine": "inner"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			want := map[string]string{"operation": "lookup_exists", "status": kvstore.OpStatusOK}
			for k, v := range tc.labels {
				want[k] = v
			}
			before := metricValue(t, reg, kvstore.VLLMMetricOperations, want)
			if _, err := s.Exists(tc.ctx, []string{"k"}); err != nil {
				t.Fatal(err)
			}
			if got := metricValue(t, reg, kvstore.VLLMMetricOperations, want); got != before+1 {
				t.Errorf("%s%v = %v after one call, want %v", kvstore.VLLMMetricOperations, want, got, before+1)
			}
		})
	}
}

func TestVLLMSeriesDeclaredOnlyForAKnownEngine(t *testing.T) {
	cases := []struct {
		name   string
		labels kvstore.VLLMLabels
		want   int // vllm:mooncake_store_operation_total series before any call
	}{
		{"model and engine", kvstore.VLLMLabels{ModelName: "m", Engine: "e"}, 2 + 3}, // save_exists ok/error, save_put ok/partial_failure/error
		{"model only (the engine comes per call)", kvstore.VLLMLabels{ModelName: "m"}, 0},
		{"none", kvstore.VLLMLabels{}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := kvstore.NewMetrics(reg)
			if err != nil {
				t.Fatal(err)
			}
			kvstore.Instrument(kvstore.NewMemory(kvstore.MemoryOptions{}), m, kvstore.OpNames{Exists: "save_exists", Put: "save_put"}).WithLabels(tc.labels)
			families, err := reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, f := range families {
				if f.GetName() == kvstore.VLLMMetricOperations {
					n = len(f.GetMetric())
				}
			}
			if n != tc.want {
				t.Errorf("%d series of %s before any call, want %d", n, kvstore.VLLMMetricOperations, tc.want)
			}
		})
	}
}
