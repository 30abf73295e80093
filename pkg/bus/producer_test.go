package bus_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/pkg/bus"
)

func TestPublishKeepsOneKeysRecordsInOrderOnOnePartition(t *testing.T) {
	const topic = "bus.test.order"
	e := newEnv(t)
	e.topics(topic)
	p := e.producer()
	var msgs []bus.Message
	for i := range 30 {
		key := fmt.Sprintf("req-%d", i%3)
		msgs = append(msgs, bus.Message{Topic: topic, Key: key, Value: []byte(fmt.Sprint(i))})
	}
	e.publish(p, msgs[:15]...)
	for _, m := range msgs[15:] { // one at a time, as services publish
		e.publish(p, m)
	}

	partitionOf := map[string]int{}
	lastValue := map[string]int{}
	for _, m := range e.readAll(topic, 30) {
		key := string(m.Key)
		if p, ok := partitionOf[key]; ok && p != m.Partition {
			t.Fatalf("key %s on partitions %d and %d", key, p, m.Partition)
		}
		partitionOf[key] = m.Partition
		var v int
		if _, err := fmt.Sscan(string(m.Value), &v); err != nil {
			t.Fatalf("value %q: %v", m.Value, err)
		}
		if last, ok := lastValue[key]; ok && v <= last {
			t.Fatalf("key %s: record %d after %d", key, v, last)
		}
		lastValue[key] = v
	}
	if len(partitionOf) != 3 {
		t.Fatalf("read keys %v, want 3", partitionOf)
	}
}

func TestPublishRejectsMessageWithoutTopic(t *testing.T) {
	p, err := bus.NewProducer([]string{"127.0.0.1:1"})
	if err != nil {
		t.Fatalf("NewProducer: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	err = p.Publish(context.Background(), bus.Message{Topic: "a"}, bus.Message{Value: []byte("x")})
	if !errors.Is(err, bus.ErrNoTopic) {
		t.Fatalf("Publish without topic = %v, want ErrNoTopic", err)
	}
	if _, err := bus.NewProducer(nil); !errors.Is(err, bus.ErrInvalidConfig) {
		t.Fatalf("NewProducer(nil) = %v, want ErrInvalidConfig", err)
	}
}

func TestEnsureTopicsIsIdempotent(t *testing.T) {
	e := newEnv(t)
	topics := []string{"bus.test.ensure-a", "bus.test.ensure-b"}
	for range 2 {
		if err := bus.EnsureTopics(e.ctx, e.brokers(), topics, 3); err != nil {
			t.Fatalf("EnsureTopics: %v", err)
		}
	}
	for _, topic := range topics {
		if n := len(e.broker.Cluster().PartitionInfos(topic)); n != 3 {
			t.Errorf("%s has %d partitions, want 3", topic, n)
		}
	}
	// An existing topic keeps its partition count.
	if err := bus.EnsureTopics(e.ctx, e.brokers(), topics[:1], 6); err != nil {
		t.Fatalf("EnsureTopics on an existing topic: %v", err)
	}
	if n := len(e.broker.Cluster().PartitionInfos(topics[0])); n != 3 {
		t.Errorf("existing topic now has %d partitions, want 3", n)
	}
}

// TestRunStopsWithoutLeaks starts and stops a broker, a producer and a
// consumer inside the test and checks that none of their goroutines remain.
func TestRunStopsWithoutLeaks(t *testing.T) {
	before := goleak.IgnoreCurrent()
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitLimit)
	defer cancel()
	const topic = "bus.test.leak"
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Topics: []string{topic, dlqTopic}, GroupMinSessionTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatalf("devbroker.Start: %v", err)
	}
	defer b.Close()
	p, err := bus.NewProducer(b.Addrs())
	if err != nil {
		t.Fatalf("NewProducer: %v", err)
	}
	e := &env{t: t, ctx: ctx, broker: b, dlq: p}
	c, err := bus.NewConsumer(e.consumerConfig("leak", topic), func(context.Context, bus.Received) error { return nil })
	if err != nil {
		t.Fatalf("NewConsumer: %v", err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	if err := p.Publish(ctx, bus.Message{Topic: topic, Key: "k", Value: []byte("v")}); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	eventually(t, "a commit", func() bool {
		g := b.Cluster().GroupInfo("leak")
		return g != nil && len(g.Commits[topic]) == 1
	})
	if err := c.Run(ctx); !errors.Is(err, bus.ErrAlreadyRunning) {
		t.Fatalf("second concurrent Run = %v, want ErrAlreadyRunning", err)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Producer.Close: %v", err)
	}
	b.Close()
	goleak.VerifyNone(t, before)
}

func TestReaderSeesRecordsPublishedWithHeaders(t *testing.T) {
	const topic = "bus.test.headers"
	e := newEnv(t)
	e.topics(topic)
	headers := map[string]string{"schema": "v1"}
	e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: []byte("v"), Headers: headers})
	if len(headers) != 1 {
		t.Fatalf("Publish modified the caller's headers: %v", headers)
	}
	got := e.readAll(topic, 1)[0]
	if !hasHeader(got.Headers, "schema", "v1") {
		t.Fatalf("record headers %v lack schema=v1", got.Headers)
	}
}

func hasHeader(hs []kafka.Header, key, value string) bool {
	for _, h := range hs {
		if h.Key == key && string(h.Value) == value {
			return true
		}
	}
	return false
}
