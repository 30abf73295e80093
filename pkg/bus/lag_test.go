package bus_test

import (
	"context"
	"fmt"
	"maps"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvmesh/kvmesh/pkg/bus"
)

func TestLagCollectorFollowsTheGroupsCommits(t *testing.T) {
	const topic, group = "bus.test.lag", "lag"
	e := newEnv(t)
	e.topics(topic)
	lc := bus.NewLagCollector(e.brokers())
	t.Cleanup(lc.Close)
	lc.Watch(group, topic)
	reg := prometheus.NewRegistry()
	reg.MustRegister(lc)

	p := e.producer()
	for i := range 5 {
		e.publish(p, bus.Message{Topic: topic, Key: fmt.Sprintf("k%d", i), Value: []byte("v")})
	}
	labels := map[string]string{"group": group, "topic": topic}
	if got := series(gather(t, reg), bus.MetricConsumerLag); len(got) != 1 || got[0].value != 5 || !maps.Equal(got[0].labels, labels) {
		t.Fatalf("before consuming: %s = %+v, want one series %v = 5", bus.MetricConsumerLag, got, labels)
	}

	stop := e.run(e.consumerConfig(group, topic), func(context.Context, bus.Received) error { return nil })
	defer stop()
	eventually(t, "lag 0 once the group committed every record", func() bool {
		got := series(gather(t, reg), bus.MetricConsumerLag)
		return len(got) == 1 && got[0].value == 0
	})
	if got := series(gather(t, reg), bus.MetricConsumerLagErrors); len(got) != 1 || got[0].value != 0 {
		t.Errorf("%s = %+v, want 0", bus.MetricConsumerLagErrors, got)
	}
}

func TestLagCollectorCountsFailedReads(t *testing.T) {
	lc := bus.NewLagCollector([]string{"127.0.0.1:1"})
	t.Cleanup(lc.Close)
	lc.Watch("g", "t")
	reg := prometheus.NewRegistry()
	reg.MustRegister(lc)
	families := gather(t, reg)
	if got := series(families, bus.MetricConsumerLag); len(got) != 0 {
		t.Fatalf("lag series with no broker = %+v; want none", got)
	}
	if got := series(families, bus.MetricConsumerLagErrors); len(got) != 1 || got[0].value != 1 {
		t.Errorf("%s = %+v, want 1", bus.MetricConsumerLagErrors, got)
	}
}

type sample struct {
	labels map[string]string
	value  float64
}

func gather(t *testing.T, reg *prometheus.Registry) []*dto.MetricFamily {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return families
}

// series returns the gauge or counter series of family name.
func series(families []*dto.MetricFamily, name string) []sample {
	var out []sample
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			s := sample{labels: map[string]string{}, value: m.GetGauge().GetValue() + m.GetCounter().GetValue()}
			for _, l := range m.GetLabel() {
				s.labels[l.GetName()] = l.GetValue()
			}
			out = append(out, s)
		}
	}
	return out
}
