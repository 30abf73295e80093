package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"
)

// adminTimeout bounds each admin request.
const adminTimeout = 10 * time.Second

// topicPollInterval is how often EnsureTopics re-reads metadata while new
// topics propagate.
const topicPollInterval = 20 * time.Millisecond

// EnsureTopics creates each of topics that does not exist yet with the given
// partition count and the cluster's default replication factor, then waits
// until metadata lists all of them. Existing topics are left as they are,
// whatever their partition count, so it is safe to call on every start.
// WithSecurity sets the TLS and SASL settings of its connections.
func EnsureTopics(ctx context.Context, brokers, topics []string, partitions int, opts ...ClientOption) error {
	if len(brokers) == 0 || partitions < 1 {
		return fmt.Errorf("%w: need brokers and a positive partition count", ErrInvalidConfig)
	}
	if len(topics) == 0 {
		return nil
	}
	client, transport, err := newClientConfig(opts).adminClient(brokers)
	if err != nil {
		return err
	}
	defer transport.CloseIdleConnections()

	req := &kafka.CreateTopicsRequest{}
	for _, t := range topics {
		req.Topics = append(req.Topics, kafka.TopicConfig{Topic: t, NumPartitions: partitions, ReplicationFactor: -1})
	}
	resp, err := client.CreateTopics(ctx, req)
	if err != nil {
		return fmt.Errorf("bus: create topics: %w", err)
	}
	for t, err := range resp.Errors {
		if err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
			return fmt.Errorf("bus: create topic %s: %w", t, err)
		}
	}
	return waitForTopics(ctx, client, topics)
}

// waitForTopics polls metadata until every topic has partitions, or ctx ends.
func waitForTopics(ctx context.Context, client *kafka.Client, topics []string) error {
	tick := time.NewTicker(topicPollInterval)
	defer tick.Stop()
	for {
		missing, err := missingTopics(ctx, client, topics)
		if err == nil && len(missing) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("bus: waiting for topics %v: %w", missing, ctx.Err())
		case <-tick.C:
		}
	}
}

// missingTopics returns the topics metadata does not list with partitions.
func missingTopics(ctx context.Context, client *kafka.Client, topics []string) ([]string, error) {
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return topics, err
	}
	ready := make(map[string]bool, len(md.Topics))
	for _, t := range md.Topics {
		ready[t.Name] = t.Error == nil && len(t.Partitions) > 0
	}
	var missing []string
	for _, t := range topics {
		if !ready[t] {
			missing = append(missing, t)
		}
	}
	return missing, nil
}

// Ping asks the cluster for its metadata: a readiness check that the brokers
// answer the Kafka protocol, not only that a port is open (and, with
// WithSecurity, that the TLS handshake and SASL authentication succeed).
func Ping(ctx context.Context, brokers []string, opts ...ClientOption) error {
	if len(brokers) == 0 {
		return fmt.Errorf("%w: no brokers", ErrInvalidConfig)
	}
	client, transport, err := newClientConfig(opts).adminClient(brokers)
	if err != nil {
		return err
	}
	defer transport.CloseIdleConnections()
	if _, err := client.Metadata(ctx, &kafka.MetadataRequest{}); err != nil {
		return fmt.Errorf("bus: ping %v: %w", brokers, err)
	}
	return nil
}
