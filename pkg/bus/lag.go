package bus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
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
	client    *kgo.Client
	admin     *kadm.Client
	clientErr error // from kgo.NewClient; every read reports it
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
	client, err := newLagClient(brokers, newClientConfig(opts).security)
	c := &LagCollector{
		client:    client,
		clientErr: err,
		lag: prometheus.NewDesc(MetricConsumerLag,
			"Records not yet committed by a consumer group, by group and topic (read from the brokers at scrape time).",
			[]string{"group", "topic"}, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricConsumerLagErrors,
			Help: "Failed reads of consumer-group lag from the brokers.",
		}),
	}
	if err == nil {
		c.admin = kadm.NewClient(client)
	}
	return c
}

// newLagClient returns the franz-go client of a LagCollector.
func newLagClient(brokers []string, s Security) (*kgo.Client, error) {
	secOpts, err := s.kgoOpts()
	if err != nil {
		return nil, err
	}
	return kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.RetryTimeout(lagTimeout)}, secOpts...)...)
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
	if c.client != nil {
		c.client.Close()
	}
}

// Lag returns group's lag on each of topics, computed by kadm from the
// group's commits (kadm.FetchOffsetsForTopics: uncommitted partitions count
// from their start offset) and the partitions' start and end offsets. Any
// partition whose offsets could not be read makes it an error.
func (c *LagCollector) Lag(ctx context.Context, group string, topics []string) (map[string]int64, error) {
	if c.clientErr != nil {
		return nil, fmt.Errorf("bus: lag client: %w", c.clientErr)
	}
	starts, err := c.admin.ListStartOffsets(ctx, topics...)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("bus: list start offsets: %w", err)
	}
	ends, err := c.admin.ListEndOffsets(ctx, topics...)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("bus: list end offsets: %w", err)
	}
	commits, err := c.admin.FetchOffsetsForTopics(ctx, group, topics...)
	if errors.Is(err, kerr.GroupIDNotFound) { // a group yet to commit: nothing consumed
		commits, err = make(kadm.OffsetResponses), nil
		ends.Each(func(o kadm.ListedOffset) {
			if commits[o.Topic] == nil {
				commits[o.Topic] = map[int32]kadm.OffsetResponse{}
			}
			commits[o.Topic][o.Partition] = kadm.OffsetResponse{Offset: kadm.Offset{Topic: o.Topic, Partition: o.Partition, At: -1}}
		})
	}
	if err == nil {
		err = commits.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("bus: fetch offsets of %s: %w", group, err)
	}
	lags := kadm.CalculateGroupLagWithStartOffsets(kadm.DescribedGroup{Group: group}, commits, starts, ends)
	out := make(map[string]int64, len(topics))
	for _, t := range topics {
		out[t] = 0
		for _, p := range lags[t] {
			if p.Err != nil {
				return nil, fmt.Errorf("bus: lag of %s on %s/%d: %w", group, t, p.Partition, p.Err)
			}
			out[t] += p.Lag
		}
	}
	return out, nil
}
