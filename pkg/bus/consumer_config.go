package bus

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// Defaults of ConsumerConfig and its retry.Policy (DefaultRetry).
const (
	// DefaultMaxWait bounds how long one fetch waits for new records. A
	// fetch returns as soon as a record arrives (Kafka and kfake answer a
	// waiting fetch when a record is produced), so a longer wait costs no
	// latency: it makes an idle consumer's fetch of each partition one long
	// poll a second. It does bound how long stopping (or a rebalance) waits
	// for the fetch in flight, so it stays well under the rebalance and
	// shutdown timeouts. (It was 250 ms: an idle TP8 mesh's broker spent
	// 49 ms of CPU a second answering empty fetches, 29 ms with 1 s.)
	DefaultMaxWait = time.Second
	// DefaultCommitInterval is how often handled records' offsets are
	// committed, in one request per interval, unless SyncCommit is set.
	DefaultCommitInterval = 100 * time.Millisecond
	// DefaultSessionTimeout is the group session timeout; it must be at
	// least the broker's minimum (6 s on Kafka and kfake by default).
	DefaultSessionTimeout = 10 * time.Second
	// DefaultHeartbeatInterval is how often a member heartbeats, and so how
	// soon it notices a rebalance.
	DefaultHeartbeatInterval = time.Second
	// DefaultRebalanceTimeout is how long the coordinator waits for members
	// to rejoin during a rebalance.
	DefaultRebalanceTimeout = 10 * time.Second
	// DefaultJoinGroupBackoff is the wait before rejoining after an error.
	DefaultJoinGroupBackoff = time.Second
	// DefaultMaxAttempts is how many times a transient failure is tried.
	DefaultMaxAttempts = 5
	// DefaultInitialBackoff is the wait after the first failed attempt.
	DefaultInitialBackoff = 100 * time.Millisecond
	// DefaultMaxBackoff caps the exponential backoff.
	DefaultMaxBackoff = 5 * time.Second
	// DefaultBatchSize is the most records a batch consumer hands its
	// BatchHandler in one call.
	DefaultBatchSize = 256
	// DefaultBatchLinger is how long a batch consumer keeps a batch open
	// for more records after its first record arrived.
	DefaultBatchLinger = 500 * time.Microsecond
)

// Received is one record handed to a Handler: the message and where it came
// from.
type Received struct {
	Message
	// Partition is the partition the record was read from.
	Partition int
	// Offset is the record's offset in its partition.
	Offset int64
	// Time is the record's timestamp.
	Time time.Time
}

// Handler processes one record. It returns nil once the record's effects are
// durable (the consumer commits its offset after that), Transient(err) for a
// failure worth retrying, or Permanent(reason, err) for a record that can
// never succeed, such as Permanent(kvcore.ReasonUndecodable, err). Other errors are
// retried like transient ones. A Handler must be idempotent: delivery is at
// least once.
type Handler func(ctx context.Context, m Received) error

// DeadLetterFunc records a dead letter in the service's own store before the
// record is published to the dead-letter topic. If it fails, the consumer
// retries it (with the publish) and does not commit, so it must be
// idempotent.
type DeadLetterFunc func(ctx context.Context, m Received, reason kvcore.Reason, cause error) error

// DefaultRetry is the consumers' retry.Policy, which zero fields of
// ConsumerConfig.Retry take: DefaultMaxAttempts handler calls before a
// record that keeps failing is dead-lettered, the wait after the first
// failure DefaultInitialBackoff, doubling up to DefaultMaxBackoff.
func DefaultRetry() retry.Policy { return retryDefaults(retry.Policy{}) }

// retryDefaults fills p's zero fields with the defaults (a cap below an
// explicit initial wait left zero becomes that wait).
func retryDefaults(p retry.Policy) retry.Policy {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if p.Backoff.Initial == 0 {
		p.Backoff.Initial = DefaultInitialBackoff
	}
	if p.Backoff.Max == 0 {
		p.Backoff.Max = max(DefaultMaxBackoff, p.Backoff.Initial)
	}
	return p
}

// validateRetry refuses a policy without attempts or with a cap below its
// first wait.
func validateRetry(p retry.Policy) error {
	if p.MaxAttempts < 1 || p.Backoff.Initial <= 0 || p.Backoff.Max < p.Backoff.Initial {
		return fmt.Errorf("%w: retry policy %+v", ErrInvalidConfig, p)
	}
	return nil
}

// Outcome is the result of one handler attempt, as reported to Hooks.
type Outcome string

// Handler attempt outcomes.
const (
	// OutcomeOK: the handler succeeded; the offset will be committed.
	OutcomeOK Outcome = "ok"
	// OutcomeRetry: the handler failed transiently and will be retried.
	OutcomeRetry Outcome = "retry"
	// OutcomeFailed: the handler failed for good; the record is dead-lettered.
	OutcomeFailed Outcome = "failed"
	// OutcomeInterrupted: the consumer stopped during the attempt; the
	// offset is not committed and the record will be delivered again.
	OutcomeInterrupted Outcome = "interrupted"
)

// Hooks lets a service observe the consumer, for metrics. Nil funcs are
// skipped. They must be fast: they run on the goroutine that handled the
// record, and with Concurrency above 1 on several goroutines at once.
type Hooks struct {
	// Handled is called after each handler attempt, once per record. In
	// batch mode it is called for every record of the batch after each
	// batch attempt, with the batch's elapsed time: OutcomeOK for a record
	// whose effects are durable, OutcomeFailed for one listed in
	// RecordErrors with a permanent error (it is dead-lettered), and
	// OutcomeRetry for one that is handled again (a batch-level failure, or
	// a transient error in RecordErrors).
	Handled func(topic string, outcome Outcome, elapsed time.Duration)
	// DeadLettered is called after a record was dead-lettered.
	DeadLettered func(topic string, reason kvcore.Reason)
}

// ConsumerConfig configures NewConsumer. Brokers, GroupID, Topics and a
// dead-letter sink (DLQTopic with Producer, or OnDeadLetter, or both) are
// required; the rest have defaults.
type ConsumerConfig struct {
	// Brokers are the bootstrap addresses.
	Brokers []string
	// Security is the TLS and SASL settings of the consumer's connections
	// (the dead-letter Producer has its own); the zero value is plaintext
	// without authentication.
	Security Security
	// GroupID is the consumer group.
	GroupID string
	// Topics are the topics to consume.
	Topics []string
	// DLQTopic receives dead letters, published through Producer. It must not
	// be one of Topics.
	DLQTopic string
	// Producer publishes dead letters; required with DLQTopic. The consumer
	// does not close it.
	Producer *Producer
	// OnDeadLetter, if set, records each dead letter before it is published.
	OnDeadLetter DeadLetterFunc
	// Retry bounds retries of transient failures.
	Retry retry.Policy
	// Logger receives dead-letter, retry and commit-failure events. Default
	// slog.Default().
	Logger *slog.Logger
	// Hooks observes handler outcomes.
	Hooks Hooks
	// TracerProvider makes the consumer spans; default the global provider.
	TracerProvider trace.TracerProvider
	// SyncCommit commits each record's offset synchronously before the next
	// fetch (about 1.5 ms per record) instead of every CommitInterval. A
	// batch consumer commits each batch so; with Concurrency above 1 each
	// advance of the committed watermarks is committed so, off the lanes.
	SyncCommit bool
	// CommitInterval is how often the offsets of handled records are
	// committed; pending ones are also committed on rebalance and when Run
	// returns. Default DefaultCommitInterval.
	CommitInterval time.Duration
	// MaxWait bounds how long one fetch waits for records. Default
	// DefaultMaxWait.
	MaxWait time.Duration
	// SessionTimeout, HeartbeatInterval, RebalanceTimeout and
	// JoinGroupBackoff tune group membership; see the Default constants.
	SessionTimeout, HeartbeatInterval, RebalanceTimeout, JoinGroupBackoff time.Duration
	// StartAtLatest makes a group without committed offsets start at the end
	// of each partition instead of the beginning.
	StartAtLatest bool
	// Concurrency is the number of lanes of a consumer made by NewConsumer:
	// with N above 1 it fetches ahead and hands each record to the lane
	// chosen by a hash of its key, so records with one key are handled in
	// order, one at a time, while records with different keys overlap (a
	// record without a key goes to the lane of its partition). Each lane
	// settles its records as the single-record mode does (retry, then
	// dead-letter). Offsets are committed per partition only up to the
	// first record not yet settled, and at most 2·N² records (2N per lane
	// on average) are fetched ahead of that point. Records in flight when a
	// partition moves to another member are still settled and committed
	// here, which can only cause redelivery, never a skip. Default 1: one
	// record at a time. NewBatchConsumer rejects a value above 1.
	Concurrency int
	// BatchSize is the most records one BatchHandler call receives
	// (NewBatchConsumer only). Default DefaultBatchSize.
	BatchSize int
	// BatchLinger is how long a batch stays open for more records after its
	// first record arrived (NewBatchConsumer only): records the reader has
	// already buffered join at once, and the batch is handed over when it
	// holds BatchSize records or BatchLinger has passed, whichever comes
	// first. Default DefaultBatchLinger.
	BatchLinger time.Duration
}

// withDefaults returns c with every unset optional field given its default.
func (c ConsumerConfig) withDefaults() ConsumerConfig {
	c.Retry = retryDefaults(c.Retry)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.CommitInterval = orDefault(c.CommitInterval, DefaultCommitInterval)
	c.MaxWait = orDefault(c.MaxWait, DefaultMaxWait)
	c.SessionTimeout = orDefault(c.SessionTimeout, DefaultSessionTimeout)
	c.HeartbeatInterval = orDefault(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.RebalanceTimeout = orDefault(c.RebalanceTimeout, DefaultRebalanceTimeout)
	c.JoinGroupBackoff = orDefault(c.JoinGroupBackoff, DefaultJoinGroupBackoff)
	c.BatchLinger = orDefault(c.BatchLinger, DefaultBatchLinger)
	if c.Concurrency == 0 {
		c.Concurrency = 1
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	return c
}

func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// validate checks a defaulted config.
func (c ConsumerConfig) validate() error {
	switch {
	case len(c.Brokers) == 0:
		return fmt.Errorf("%w: no brokers", ErrInvalidConfig)
	case c.GroupID == "":
		return fmt.Errorf("%w: no group id", ErrInvalidConfig)
	case len(c.Topics) == 0 || slices.Contains(c.Topics, ""):
		return fmt.Errorf("%w: no topics or an empty topic name", ErrInvalidConfig)
	case c.DLQTopic == "" && c.OnDeadLetter == nil:
		return fmt.Errorf("%w: no dead-letter sink (DLQTopic or OnDeadLetter)", ErrInvalidConfig)
	case c.DLQTopic != "" && c.Producer == nil:
		return fmt.Errorf("%w: DLQTopic without a Producer", ErrInvalidConfig)
	case slices.Contains(c.Topics, c.DLQTopic):
		return fmt.Errorf("%w: DLQ topic %s is also consumed", ErrInvalidConfig, c.DLQTopic)
	case c.CommitInterval < 0 || c.MaxWait < 0 || c.SessionTimeout < 0 || c.RebalanceTimeout < 0 || c.JoinGroupBackoff < 0 ||
		c.BatchLinger < 0:
		return fmt.Errorf("%w: negative duration", ErrInvalidConfig)
	case c.HeartbeatInterval <= 0 || c.HeartbeatInterval >= c.SessionTimeout:
		return fmt.Errorf("%w: heartbeat interval must be below the session timeout", ErrInvalidConfig)
	case c.Concurrency < 1:
		return fmt.Errorf("%w: concurrency %d is not positive", ErrInvalidConfig, c.Concurrency)
	case c.BatchSize < 1:
		return fmt.Errorf("%w: batch size %d is not positive", ErrInvalidConfig, c.BatchSize)
	}
	if err := c.Security.Validate(); err != nil {
		return err
	}
	return validateRetry(c.Retry)
}
