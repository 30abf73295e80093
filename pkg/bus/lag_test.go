package bus_test

import (
	"context"
	"fmt"
	"maps"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/segmentio/kafka-go"

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

// TestLagCountsEachPartitionFromItsCommit: a partition's lag is its end
// offset minus the group's commit, a commit past the end counts 0, and a
// partition the group never committed counts from its first offset; the
// figures are summed per topic, and an unknown topic is an error.
func TestLagCountsEachPartitionFromItsCommit(t *testing.T) {
	const topic, group = "bus.test.lag.parts", "lag-parts"
	e := newEnv(t)
	e.topicsWith(3, topic)
	p := e.producer()
	for i := range 12 {
		e.publish(p, bus.Message{Topic: topic, Key: fmt.Sprintf("k%d", i), Value: []byte("v")})
	}
	transport := &kafka.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	client := &kafka.Client{Addr: kafka.TCP(e.brokers()...), Transport: transport}
	listed, err := client.ListOffsets(e.ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		topic: {kafka.LastOffsetOf(0), kafka.LastOffsetOf(1), kafka.LastOffsetOf(2)}}})
	if err != nil {
		t.Fatalf("ListOffsets: %v", err)
	}
	ends := map[int]int64{}
	for _, po := range listed.Topics[topic] {
		ends[po.Partition] = po.LastOffset
	}
	// Partition 0 committed one short of its end, partition 1 past its
	// end, partition 2 never.
	resp, err := client.OffsetCommit(e.ctx, &kafka.OffsetCommitRequest{GroupID: group, GenerationID: -1,
		Topics: map[string][]kafka.OffsetCommit{topic: {{Partition: 0, Offset: max(ends[0]-1, 0)}, {Partition: 1, Offset: ends[1] + 5}}}})
	if err != nil {
		t.Fatalf("OffsetCommit: %v", err)
	}
	for _, pc := range resp.Topics[topic] {
		if pc.Error != nil {
			t.Fatalf("OffsetCommit of partition %d: %v", pc.Partition, pc.Error)
		}
	}
	want := min(ends[0], 1) + ends[2]

	lc := bus.NewLagCollector(e.brokers())
	t.Cleanup(lc.Close)
	lag, err := lc.Lag(e.ctx, group, []string{topic})
	if err != nil || len(lag) != 1 || lag[topic] != want {
		t.Fatalf("Lag = %v, %v; want %s: %d (ends %v)", lag, err, topic, want, ends)
	}
	if lag, err := lc.Lag(e.ctx, "never-committed", []string{topic}); err != nil || lag[topic] != 12 {
		t.Errorf("Lag of a group without commits = %v, %v; want 12", lag, err)
	}
	if lag, err := lc.Lag(e.ctx, group, []string{"bus.test.lag.missing"}); err == nil {
		t.Errorf("Lag of an unknown topic = %v, want an error", lag)
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
