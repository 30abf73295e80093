package kvstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// metricValue reads a counter's value or a histogram's sample count from
// reg: the series of family name whose labels include want. It is 0 when
// the series does not exist.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if !hasLabels(m, want) {
				continue
			}
			if h := m.GetHistogram(); h != nil {
				return float64(h.GetSampleCount())
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

func TestInstrumentedRecordsCallsKeysAndFailures(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	m, err := kvstore.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	mem := kvstore.NewMemory(kvstore.MemoryOptions{MaxValueBytes: 4})
	s := kvstore.Instrument(mem, m, kvstore.OpNames{Exists: "lookup_exists"})

	if _, err := s.Put(ctx, []kvstore.Item{{Key: "a", Value: []byte("1")}, {Key: "b", Value: []byte("too big")}}); err != nil {
		t.Fatal(err)
	}
	if found, err := s.Exists(ctx, []string{"a", "b", "c"}); err != nil || !found[0] || found[1] || found[2] {
		t.Fatalf("Exists = %v, %v; want [true false false]", found, err)
	}
	if _, errs, err := s.Get(ctx, []string{"a", "zz"}); err != nil || errs[0] != nil || !errors.Is(errs[1], kvstore.ErrNotFound) {
		t.Fatalf("Get = %v, %v", errs, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exists(ctx, []string{"a", "b"}); !errors.Is(err, kvstore.ErrClosed) {
		t.Fatalf("Exists after Close = %v, want ErrClosed", err)
	}

	cases := []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{kvstore.MetricOpDuration, map[string]string{"op": "lookup_exists"}, 2},
		{kvstore.MetricOpDuration, map[string]string{"op": "put"}, 1},
		{kvstore.MetricOpDuration, map[string]string{"op": "get"}, 1},
		{kvstore.MetricOpDuration, map[string]string{"op": "exists"}, 0},
		{kvstore.MetricKeys, map[string]string{"op": "lookup_exists"}, 5},
		{kvstore.MetricKeys, map[string]string{"op": "put"}, 2},
		{kvstore.MetricFailedKeys, map[string]string{"op": "put", "status": kvstore.StatusTooLarge}, 1},
		{kvstore.MetricFailedKeys, map[string]string{"op": "get", "status": kvstore.StatusNotFound}, 1},
		{kvstore.MetricFailedKeys, map[string]string{"op": "lookup_exists", "status": kvstore.StatusClosed}, 2},
	}
	for _, tc := range cases {
		if got := metricValue(t, reg, tc.name, tc.labels); got != tc.want {
			t.Errorf("%s%v = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
}

func TestNewMetricsTwiceOnOneRegistryShares(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, err := kvstore.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	b, err := kvstore.NewMetrics(reg)
	if err != nil {
		t.Fatalf("second NewMetrics: %v", err)
	}
	ctx := context.Background()
	_, _ = kvstore.Instrument(kvstore.NewMemory(kvstore.MemoryOptions{}), a, kvstore.OpNames{}).Exists(ctx, []string{"k"})
	_, _ = kvstore.Instrument(kvstore.NewMemory(kvstore.MemoryOptions{}), b, kvstore.OpNames{}).Exists(ctx, []string{"k"})
	if got := metricValue(t, reg, kvstore.MetricOpDuration, map[string]string{"op": "exists"}); got != 2 {
		t.Fatalf("two wrappers on one registry recorded %v calls, want 2", got)
	}
}

func TestFailureStatus(t *testing.T) {
	cases := []struct {
		err  error
		want string
	}{
		{fmt.Errorf("x: %w", kvstore.ErrNotFound), kvstore.StatusNotFound},
		{fmt.Errorf("x: %w", kvstore.ErrNoSpace), kvstore.StatusNoSpace},
		{fmt.Errorf("x: %w", kvstore.ErrTooLarge), kvstore.StatusTooLarge},
		{fmt.Errorf("x: %w", kvstore.ErrClosed), kvstore.StatusClosed},
		{fmt.Errorf("x: %w", kvstore.ErrUnavailable), kvstore.StatusUnavailable},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), kvstore.StatusTimeout},
		{fmt.Errorf("x: %w", context.Canceled), kvstore.StatusCanceled},
		{errors.New("other"), kvstore.StatusError},
	}
	for _, tc := range cases {
		if got := kvstore.FailureStatus(tc.err); got != tc.want {
			t.Errorf("FailureStatus(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

func TestInstrumentedSpans(t *testing.T) {
	rec := testenv.RecordSpans(t)
	ctx := context.Background()
	m, err := kvstore.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	mem := kvstore.NewMemory(kvstore.MemoryOptions{MaxValueBytes: 4})
	s := kvstore.Instrument(mem, m, kvstore.OpNames{Put: "save_put", Get: "load_get"})
	if _, err := s.Put(ctx, []kvstore.Item{{Key: "a", Value: []byte("12")}, {Key: "b", Value: []byte("too big")}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Get(ctx, []string{"a", "zz"}); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	if _, err := s.Exists(ctx, []string{"a"}); err == nil {
		t.Fatal("Exists after Close succeeded")
	}

	type want struct {
		name   string
		ints   map[string]int64
		failed bool
	}
	wants := []want{
		{"store save_put", map[string]int64{"kvmesh.store.keys": 2, "kvmesh.bytes": 9, "kvmesh.store.failed_keys": 1}, false},
		{"store load_get", map[string]int64{"kvmesh.store.keys": 2, "kvmesh.bytes": 2, "kvmesh.store.failed_keys": 1}, false},
		{"store exists", map[string]int64{"kvmesh.store.keys": 1}, true},
	}
	spans := rec.Ended()
	if len(spans) != len(wants) {
		t.Fatalf("%d spans, want %d", len(spans), len(wants))
	}
	for i, w := range wants {
		sp := spans[i]
		if sp.Name() != w.name || sp.SpanKind() != trace.SpanKindClient {
			t.Errorf("span %d = %q kind %v, want %q client", i, sp.Name(), sp.SpanKind(), w.name)
		}
		got := map[string]int64{}
		for _, kv := range sp.Attributes() {
			if kv.Value.Type() == attribute.INT64 {
				got[string(kv.Key)] = kv.Value.AsInt64()
			}
		}
		for k, v := range w.ints {
			if got[k] != v {
				t.Errorf("%s: %s = %d, want %d", w.name, k, got[k], v)
			}
		}
		if failed := sp.Status().Code == codes.Error; failed != w.failed {
			t.Errorf("%s: error status %v, want %v", w.name, failed, w.failed)
		}
	}
}
