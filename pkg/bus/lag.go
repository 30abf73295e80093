package bus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
)

// Names of the consumer-lag metric families.
const (
	MetricConsumerLag       = "kvmesh_consumer_lag"
	MetricConsumerLagErrors = "kvmesh_consumer_lag_errors_total"
)

// lagTimeout bounds one lag read during a scrape.
const lagTimeout = 3 * time.Second

// LagCollector is a Prometheus collector of consumer-group lag: for every
// watched group and topic, the records on the topic's partitions that the
// group has not committed yet (end offset minus committed offset, summed over
// partitions; a partition without a commit counts from its first offset). It
// asks the brokers at scrape time, so the figure covers every partition of
// the topic, whichever group member owns it, and also grows while a consumer
// is stuck. A failed read leaves that group's series out of the scrape and
// counts an error.
type LagCollector struct {
	client    *kafka.Client
	transport *kafka.Transport
	lag       *prometheus.Desc
	errors    prometheus.Counter

	mu      sync.Mutex
	watches []lagWatch
}

type lagWatch struct {
	group  string
	topics []string
}

// NewLagCollector returns a collector asking brokers; Close releases its
// connections.
func NewLagCollector(brokers []string) *LagCollector {
	transport := &kafka.Transport{}
	return &LagCollector{
		client:    &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport, Timeout: lagTimeout},
		transport: transport,
		lag: prometheus.NewDesc(MetricConsumerLag,
			"Records not yet committed by a consumer group, by group and topic (read from the brokers at scrape time).",
			[]string{"group", "topic"}, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricConsumerLagErrors,
			Help: "Failed reads of consumer-group lag from the brokers.",
		}),
	}
}

// Watch adds group's lag on topics to what the collector reports. Watching
// the same group again adds its new topics only.
func (c *LagCollector) Watch(group string, topics ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, w := range c.watches {
		if w.group == group {
			for _, t := range topics {
				if !slices.Contains(w.topics, t) {
					c.watches[i].topics = append(c.watches[i].topics, t)
				}
			}
			return
		}
	}
	c.watches = append(c.watches, lagWatch{group: group, topics: slices.Clone(topics)})
}

// Describe implements prometheus.Collector.
func (c *LagCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.lag
	c.errors.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *LagCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	watches := slices.Clone(c.watches)
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), lagTimeout)
	defer cancel()
	for _, w := range watches {
		lag, err := c.Lag(ctx, w.group, w.topics)
		if err != nil {
			c.errors.Inc()
			continue
		}
		for _, t := range w.topics {
			ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, float64(lag[t]), w.group, t)
		}
	}
	c.errors.Collect(ch)
}

// Close releases the collector's broker connections.
func (c *LagCollector) Close() {
	c.transport.CloseIdleConnections()
}

// Lag returns group's lag on each of topics.
func (c *LagCollector) Lag(ctx context.Context, group string, topics []string) (map[string]int64, error) {
	parts, err := c.partitions(ctx, topics)
	if err != nil {
		return nil, err
	}
	ends, err := c.offsets(ctx, parts)
	if err != nil {
		return nil, err
	}
	committed, err := c.committed(ctx, group, parts)
	if err != nil {
		return nil, err
	}
	lag := make(map[string]int64, len(topics))
	for topic, ps := range ends {
		done := committed[topic]
		for _, p := range ps {
			from, ok := done[p.Partition]
			if !ok {
				from = p.FirstOffset
			}
			lag[topic] += max(0, p.LastOffset-from)
		}
	}
	return lag, nil
}

// committed returns group's committed offset per topic and partition; a
// group that does not exist yet has none.
func (c *LagCollector) committed(ctx context.Context, group string, parts map[string][]int) (map[string]map[int]int64, error) {
	resp, err := c.client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: parts})
	if err == nil {
		err = resp.Error
	}
	if errors.Is(err, kafka.GroupIdNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bus: fetch offsets of %s: %w", group, err)
	}
	out := make(map[string]map[int]int64, len(resp.Topics))
	for topic, ps := range resp.Topics {
		out[topic] = map[int]int64{}
		for _, p := range ps {
			if p.Error == nil && p.CommittedOffset >= 0 {
				out[topic][p.Partition] = p.CommittedOffset
			}
		}
	}
	return out, nil
}

// partitions lists the partition ids of every topic.
func (c *LagCollector) partitions(ctx context.Context, topics []string) (map[string][]int, error) {
	md, err := c.client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return nil, fmt.Errorf("bus: metadata: %w", err)
	}
	out := make(map[string][]int, len(topics))
	for _, t := range md.Topics {
		if t.Error != nil {
			return nil, fmt.Errorf("bus: metadata of %s: %w", t.Name, t.Error)
		}
		for _, p := range t.Partitions {
			out[t.Name] = append(out[t.Name], p.ID)
		}
	}
	return out, nil
}

// offsets lists the first and end offsets of every partition.
func (c *LagCollector) offsets(ctx context.Context, parts map[string][]int) (map[string][]kafka.PartitionOffsets, error) {
	req := &kafka.ListOffsetsRequest{Topics: make(map[string][]kafka.OffsetRequest, len(parts))}
	for t, ps := range parts {
		for _, p := range ps {
			req.Topics[t] = append(req.Topics[t], kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p))
		}
	}
	resp, err := c.client.ListOffsets(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("bus: list offsets: %w", err)
	}
	for t, ps := range resp.Topics {
		for _, p := range ps {
			if p.Error != nil {
				return nil, fmt.Errorf("bus: list offsets of %s/%d: %w", t, p.Partition, p.Error)
			}
		}
	}
	return resp.Topics, nil
}
