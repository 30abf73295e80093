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
	clientErr error // from the security settings; every read reports it
	lag       *prometheus.Desc
	errors    prometheus.Counter

	mu      sync.Mutex
	watches []lagWatch
}

type lagWatch struct {
	group  string
	topics []string
}

// NewLagCollector returns a collector asking brokers, with the TLS and SASL
// settings WithSecurity gives; Close releases its connections. A setting
// that cannot be used (an unreadable TLS file) makes every read fail with
// its error.
func NewLagCollector(brokers []string, opts ...ClientOption) *LagCollector {
	client, transport, err := newClientConfig(opts).adminClient(brokers)
	if client != nil {
		client.Timeout = lagTimeout
	}
	return &LagCollector{
		client:    client,
		transport: transport,
		clientErr: err,
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
	if c.transport != nil {
		c.transport.CloseIdleConnections()
	}
}

// Lag returns group's lag on each of topics, computed with kafka-go's
// offset APIs: the topics' partitions from metadata, their first and end
// offsets (ListOffsets) and the group's commits (OffsetFetch). A partition
// the group has not committed counts from its first offset; a commit past
// the end counts 0. Any topic or partition whose offsets could not be read
// makes it an error.
func (c *LagCollector) Lag(ctx context.Context, group string, topics []string) (map[string]int64, error) {
	if c.clientErr != nil {
		return nil, fmt.Errorf("bus: lag client: %w", c.clientErr)
	}
	parts, err := c.partitions(ctx, topics)
	if err != nil {
		return nil, err
	}
	offsets, err := c.listOffsets(ctx, parts)
	if err != nil {
		return nil, err
	}
	commits, err := c.commits(ctx, group, parts)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int64, len(topics))
	for _, t := range topics {
		out[t] = 0
		for _, p := range parts[t] {
			o := offsets[t][p]
			lag := o.LastOffset - o.FirstOffset
			if at, ok := commits[t][p]; ok && at >= 0 {
				lag = o.LastOffset - at
			}
			out[t] += max(lag, 0)
		}
	}
	return out, nil
}

// partitions returns the partition ids of each of topics, from metadata; a
// topic the brokers do not know is an error.
func (c *LagCollector) partitions(ctx context.Context, topics []string) (map[string][]int, error) {
	md, err := c.client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return nil, fmt.Errorf("bus: lag metadata: %w", err)
	}
	parts := make(map[string][]int, len(topics))
	for _, t := range md.Topics {
		if t.Error != nil {
			return nil, fmt.Errorf("bus: lag metadata of %s: %w", t.Name, t.Error)
		}
		for _, p := range t.Partitions {
			parts[t.Name] = append(parts[t.Name], p.ID)
		}
	}
	for _, t := range topics {
		if _, ok := parts[t]; !ok {
			return nil, fmt.Errorf("bus: lag metadata of %s: %w", t, kafka.UnknownTopicOrPartition)
		}
	}
	return parts, nil
}

// listOffsets returns the first and end offsets of every partition of
// parts, by topic and partition.
func (c *LagCollector) listOffsets(ctx context.Context, parts map[string][]int) (map[string]map[int]kafka.PartitionOffsets, error) {
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
	out := make(map[string]map[int]kafka.PartitionOffsets, len(parts))
	for t, ps := range resp.Topics {
		out[t] = make(map[int]kafka.PartitionOffsets, len(ps))
		for _, p := range ps {
			if p.Error != nil {
				return nil, fmt.Errorf("bus: list offsets of %s/%d: %w", t, p.Partition, p.Error)
			}
			out[t][p.Partition] = p
		}
	}
	for t, ps := range parts {
		for _, p := range ps {
			if _, ok := out[t][p]; !ok {
				return nil, fmt.Errorf("bus: list offsets of %s/%d: no answer", t, p)
			}
		}
	}
	return out, nil
}

// commits returns group's committed offset of each partition of parts
// that it has committed (a partition without a commit is left out or
// has -1); a group the coordinator does not know has committed nothing.
func (c *LagCollector) commits(ctx context.Context, group string, parts map[string][]int) (map[string]map[int]int64, error) {
	resp, err := c.client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: parts})
	if err == nil {
		err = resp.Error
	}
	if errors.Is(err, kafka.GroupIdNotFound) { // a group yet to commit: nothing consumed
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bus: fetch offsets of %s: %w", group, err)
	}
	out := make(map[string]map[int]int64, len(resp.Topics))
	for t, ps := range resp.Topics {
		out[t] = make(map[int]int64, len(ps))
		for _, p := range ps {
			if p.Error != nil {
				return nil, fmt.Errorf("bus: fetch offsets of %s on %s/%d: %w", group, t, p.Partition, p.Error)
			}
			out[t][p.Partition] = p.CommittedOffset
		}
	}
	return out, nil
}
