package devbroker_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func start(t *testing.T, cfg devbroker.Config) *devbroker.Broker {
	t.Helper()
	b, err := devbroker.Start(testContext(t), cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(b.Close)
	return b
}

func client(t *testing.T, b *devbroker.Broker) *kafka.Client {
	t.Helper()
	transport := &kafka.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	return &kafka.Client{Addr: kafka.TCP(b.Addrs()...), Transport: transport, Timeout: 5 * time.Second}
}

// writer returns a kafka-go writer with its own transport, closed at cleanup
// so that no connection goroutine outlives the test.
func writer(t *testing.T, addrs []string, topic string) *kafka.Writer {
	t.Helper()
	transport := &kafka.Transport{}
	w := &kafka.Writer{Addr: kafka.TCP(addrs...), Topic: topic, BatchTimeout: 5 * time.Millisecond, Transport: transport}
	t.Cleanup(func() {
		if err := w.Close(); err != nil {
			t.Errorf("Writer.Close: %v", err)
		}
		transport.CloseIdleConnections()
	})
	return w
}

func TestConfigValidate(t *testing.T) {
	tests := []validateCase{
		{"zero value takes defaults", devbroker.Config{}, true},
		{"port zero", devbroker.Config{Addr: "127.0.0.1:0"}, true},
		{"localhost", devbroker.Config{Addr: "localhost:19092"}, true},
		{"empty host", devbroker.Config{Addr: ":9092"}, true},
		{"non-loopback host", devbroker.Config{Addr: "0.0.0.0:9092"}, false},
		{"missing port", devbroker.Config{Addr: "127.0.0.1"}, false},
		{"port out of range", devbroker.Config{Addr: "127.0.0.1:70000"}, false},
		{"negative partitions", devbroker.Config{Partitions: -1}, false},
		{"too many partitions", devbroker.Config{Partitions: 5000}, false},
		{"bad topic name", devbroker.Config{Topics: []string{"a b"}}, false},
		{"empty topic name", devbroker.Config{Topics: []string{""}}, false},
		{"negative session timeout", devbroker.Config{GroupMinSessionTimeout: -time.Second}, false},
	}
	checkValidate(t, tests)
}

func TestStartCreatesContractTopics(t *testing.T) {
	b := start(t, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 3})
	md, err := client(t, b).Metadata(testContext(t), &kafka.MetadataRequest{Topics: contract.Topics})
	if err != nil {
		t.Fatalf("Metadata: %v", err)
	}
	got := map[string]int{}
	for _, topic := range md.Topics {
		if topic.Error != nil {
			t.Fatalf("topic %s: %v", topic.Name, topic.Error)
		}
		got[topic.Name] = len(topic.Partitions)
	}
	for _, name := range contract.Topics {
		if got[name] != 3 {
			t.Errorf("topic %s has %d partitions, want 3", name, got[name])
		}
	}
}

func TestProduceAndConsumeOverTCP(t *testing.T) {
	const topic = "devbroker.test.roundtrip"
	b := start(t, devbroker.Config{Addr: "127.0.0.1:0", Topics: []string{topic}})
	ctx := testContext(t)

	w := writer(t, b.Addrs(), topic)
	w.RequiredAcks = kafka.RequireAll
	if err := w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("hello")}); err != nil {
		t.Fatalf("WriteMessages: %v", err)
	}

	got := readOne(ctx, t, b, topic)
	if string(got.Key) != "k" || string(got.Value) != "hello" {
		t.Fatalf("read %q=%q, want k=hello", got.Key, got.Value)
	}
}

// readOne reads the first record of topic through a consumer group.
func readOne(ctx context.Context, t *testing.T, b *devbroker.Broker, topic string) kafka.Message {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: b.Addrs(), GroupID: "devbroker-test-" + topic, Topic: topic,
		MaxWait: 100 * time.Millisecond, StartOffset: kafka.FirstOffset,
	})
	defer r.Close()
	m, err := r.FetchMessage(ctx)
	if err != nil {
		t.Fatalf("FetchMessage: %v", err)
	}
	return m
}

func TestAutoTopicCreation(t *testing.T) {
	b := start(t, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2, Topics: []string{"devbroker.test.seed"}})
	w := writer(t, b.Addrs(), "devbroker.test.auto")
	w.AllowAutoTopicCreation = true
	if err := w.WriteMessages(testContext(t), kafka.Message{Value: []byte("x")}); err != nil {
		t.Fatalf("WriteMessages to a new topic: %v", err)
	}
	if n := len(b.Cluster().PartitionInfos("devbroker.test.auto")); n != 2 {
		t.Fatalf("auto-created topic has %d partitions, want 2", n)
	}
}

func TestDataDirKeepsCommittedOffsets(t *testing.T) {
	const (
		topic = "devbroker.test.persist"
		group = "devbroker-test-persist"
	)
	dir := t.TempDir()
	cfg := devbroker.Config{Addr: "127.0.0.1:0", Partitions: 1, DataDir: dir, Topics: []string{topic}, GroupMinSessionTimeout: 100 * time.Millisecond}
	ctx := testContext(t)

	first, err := devbroker.Start(ctx, cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	w := writer(t, first.Addrs(), topic)
	if err := w.WriteMessages(ctx, kafka.Message{Value: []byte("a")}, kafka.Message{Value: []byte("b")}, kafka.Message{Value: []byte("c")}); err != nil {
		t.Fatalf("WriteMessages: %v", err)
	}
	consumeAndCommit(ctx, t, first.Addrs(), topic, group, 2)
	first.Close()

	second := start(t, cfg)
	resp, err := client(t, second).OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: {0}}})
	if err != nil {
		t.Fatalf("OffsetFetch after restart: %v", err)
	}
	parts := resp.Topics[topic]
	if len(parts) != 1 || parts[0].CommittedOffset != 2 {
		t.Fatalf("committed offsets after restart = %+v, want offset 2", parts)
	}
	if hw := second.Cluster().PartitionInfo(topic, 0).HighWatermark; hw != 3 {
		t.Fatalf("high watermark after restart = %d, want 3", hw)
	}
}

// consumeAndCommit reads n records with a consumer group and commits them.
func consumeAndCommit(ctx context.Context, t *testing.T, addrs []string, topic, group string, n int) {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: addrs, GroupID: group, Topic: topic, MaxWait: 100 * time.Millisecond,
		SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond,
	})
	defer r.Close()
	for range n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("FetchMessage: %v", err)
		}
		if err := r.CommitMessages(ctx, m); err != nil {
			t.Fatalf("CommitMessages: %v", err)
		}
	}
}

// validateCase is a Config and whether Validate accepts it.
type validateCase struct {
	name string
	cfg  devbroker.Config
	ok   bool
}

// checkValidate runs Validate on each case: nil for the valid ones,
// ErrInvalidConfig for the others.
func checkValidate(t *testing.T, tests []validateCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.ok && err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
			if !tt.ok && !errors.Is(err, devbroker.ErrInvalidConfig) {
				t.Fatalf("Validate() = %v, want ErrInvalidConfig", err)
			}
		})
	}
}
