package bus_test

import (
	"context"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// waitLimit bounds every wait of these tests.
const waitLimit = 15 * time.Second

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// dlqTopic is the dead-letter topic every env starts with.
const dlqTopic = "bus.test.dlq"

// env is one test's embedded broker and a producer for dead letters.
type env struct {
	t      *testing.T
	ctx    context.Context
	broker *devbroker.Broker
	dlq    *bus.Producer
}

func newEnv(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitLimit)
	t.Cleanup(cancel)
	b, err := devbroker.Start(ctx, devbroker.Config{
		Addr: "127.0.0.1:0", Partitions: 4, Topics: []string{dlqTopic},
		GroupMinSessionTimeout: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatalf("devbroker.Start: %v", err)
	}
	t.Cleanup(b.Close)
	e := &env{t: t, ctx: ctx, broker: b}
	e.dlq = e.producer()
	return e
}

func (e *env) brokers() []string { return e.broker.Addrs() }

// topics creates topics with 4 partitions.
func (e *env) topics(names ...string) {
	e.t.Helper()
	if err := bus.EnsureTopics(e.ctx, e.brokers(), names, 4); err != nil {
		e.t.Fatalf("EnsureTopics: %v", err)
	}
}

func (e *env) producer() *bus.Producer {
	e.t.Helper()
	p, err := bus.NewProducer(e.brokers())
	if err != nil {
		e.t.Fatalf("NewProducer: %v", err)
	}
	e.t.Cleanup(func() {
		if err := p.Close(); err != nil {
			e.t.Errorf("Producer.Close: %v", err)
		}
	})
	return p
}

func (e *env) publish(p *bus.Producer, msgs ...bus.Message) {
	e.t.Helper()
	if err := p.Publish(e.ctx, msgs...); err != nil {
		e.t.Fatalf("Publish: %v", err)
	}
}

// consumerConfig returns a config tuned for fast group changes and retries.
func (e *env) consumerConfig(group string, topics ...string) bus.ConsumerConfig {
	return bus.ConsumerConfig{
		Brokers:           e.brokers(),
		GroupID:           group,
		Topics:            topics,
		DLQTopic:          dlqTopic,
		Producer:          e.dlq,
		Retry:             retry.Policy{MaxAttempts: 3, Backoff: retry.Backoff{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond}},
		Logger:            testLogger(),
		MaxWait:           100 * time.Millisecond,
		SessionTimeout:    2 * time.Second,
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  2 * time.Second,
		JoinGroupBackoff:  100 * time.Millisecond,
	}
}

// testLogger discards logs unless KVMESH_TEST_LOG=1.
func testLogger() *slog.Logger {
	if os.Getenv("KVMESH_TEST_LOG") == "1" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// topicsWith creates topics with the given number of partitions.
func (e *env) topicsWith(partitions int, names ...string) {
	e.t.Helper()
	if err := bus.EnsureTopics(e.ctx, e.brokers(), names, partitions); err != nil {
		e.t.Fatalf("EnsureTopics: %v", err)
	}
}

// run starts c.Run and returns a stop func that cancels it and checks that
// Run returned nil; stop also runs at cleanup and is idempotent.
func (e *env) run(cfg bus.ConsumerConfig, h bus.Handler) (stop func()) {
	e.t.Helper()
	c, err := bus.NewConsumer(cfg, h)
	if err != nil {
		e.t.Fatalf("NewConsumer: %v", err)
	}
	return e.start(c)
}

// runBatch is run for a batch consumer.
func (e *env) runBatch(cfg bus.ConsumerConfig, h bus.BatchHandler) (stop func()) {
	e.t.Helper()
	c, err := bus.NewBatchConsumer(cfg, h)
	if err != nil {
		e.t.Fatalf("NewBatchConsumer: %v", err)
	}
	return e.start(c)
}

// start runs c as run does.
func (e *env) start(c *bus.Consumer) (stop func()) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stop = sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			e.t.Errorf("Run: %v", err)
		}
	})
	e.t.Cleanup(stop)
	return stop
}

// committed returns the group's committed offset of topic/partition, or -1.
func (e *env) committed(group, topic string, partition int) int64 {
	g := e.broker.Cluster().GroupInfo(group)
	if g == nil {
		return -1
	}
	c, ok := g.Commits[topic][int32(partition)]
	if !ok {
		return -1
	}
	return c.Offset
}

// waitStable waits until the group is stable with n members that all have
// partitions.
func (e *env) waitStable(group string, n int) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.ctx, waitLimit)
	defer cancel()
	_, err := e.broker.Cluster().WaitGroupInfo(ctx, group, func(g *kfake.GroupInfo) bool {
		if g == nil || g.State != "Stable" || len(g.Members) != n {
			return false
		}
		for _, m := range g.Members {
			if m.NumAssigned() == 0 {
				return false
			}
		}
		return true
	})
	if err != nil {
		e.t.Fatalf("group %s never became stable with %d members: %v", group, n, err)
	}
}

// readAll reads n records of topic from its beginning with a fresh group.
func (e *env) readAll(topic string, n int) []kafka.Message {
	e.t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: e.brokers(), GroupID: "inspect-" + topic, Topic: topic, MaxWait: 100 * time.Millisecond,
		SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
	})
	defer r.Close()
	ctx, cancel := context.WithTimeout(e.ctx, waitLimit)
	defer cancel()
	out := make([]kafka.Message, 0, n)
	for range n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			e.t.Fatalf("reading %s: got %d of %d records: %v", topic, len(out), n, err)
		}
		out = append(out, m)
	}
	return out
}

// eventually polls cond until it holds or waitLimit passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		<-tick.C
	}
}

// seen collects what handlers saw, safely across goroutines.
type seen[T any] struct {
	mu    sync.Mutex
	items []T
}

func (l *seen[T]) add(v T) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.items = append(l.items, v)
}

func (l *seen[T]) snapshot() []T {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]T(nil), l.items...)
}

func (l *seen[T]) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.items)
}
