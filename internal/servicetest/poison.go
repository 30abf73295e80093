package servicetest

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// BrokerMaxMessageBytes is the largest produce batch the test broker
// accepts: kfake's default message.max.bytes (Kafka's own default, 1 MiB
// plus 12 bytes), which devbroker leaves as it is. A record that fits in a
// batch of this size is a record some client may put on any topic.
const BrokerMaxMessageBytes = 1048588

// PoisonDeadline is how long a service may take, after a poison record, to
// dead-letter it and to apply the valid record that follows it: the issue's
// "within seconds".
const PoisonDeadline = 5 * time.Second

// warmUpLimit bounds the first valid record of RunPoison, which waits for
// the consumer group to form.
const warmUpLimit = 30 * time.Second

// recordBatchOverhead is the v2 record-batch header (61 bytes) plus what a
// record of a ~1 MB value without headers adds to its key and value: its
// length (3 varint bytes), attributes, timestamp and offset deltas and
// header count (1 byte each), and its value length (3 varint bytes).
const recordBatchOverhead = 61 + 3 + 4 + 3

// MaxValueBytes is the size of the largest value the broker accepts in a
// record, alone in its batch, under a key of keyLen (< 64) bytes.
func MaxValueBytes(keyLen int) int {
	return BrokerMaxMessageBytes - recordBatchOverhead - 1 - keyLen
}

// Poison is one record a consumer must dead-letter without stalling.
type Poison struct {
	// Name names the case in subtests.
	Name string
	// Value is the record value.
	Value []byte
}

// PoisonRecords returns the records no consumer of the mesh may choke on,
// for a topic keyed with keyLen-byte keys whose valid records look like
// sample: random bytes of the largest size the broker accepts, sample
// truncated in its middle, and wrongSchema, a well-formed record of another
// schema.
func PoisonRecords(t testing.TB, keyLen int, sample, wrongSchema []byte) []Poison {
	t.Helper()
	junk := make([]byte, MaxValueBytes(keyLen))
	if _, err := rand.Read(junk); err != nil {
		t.Fatalf("junk bytes: %v", err)
	}
	return []Poison{
		{Name: poisonNames[0], Value: junk},
		{Name: poisonNames[1], Value: sample[:len(sample)/2]},
		{Name: poisonNames[2], Value: wrongSchema},
	}
}

// poisonNames name the cases of PoisonRecords, in its order.
var poisonNames = []string{"max_size_junk", "truncated", "wrong_schema"}

// Produced is where a record landed.
type Produced struct {
	Topic     string
	Partition int
	Offset    int64
}

// RawProducer writes records byte for byte, one per produce request, as any
// client could: unlike the mesh's producers it sets no client-side size
// limit, so the broker alone decides what is too large. It puts a record on
// the partition the mesh's murmur2 balancer picks for its key.
type RawProducer struct {
	client *kafka.Client
}

// NewRawProducer returns a RawProducer for brokers, closed when the test ends.
func NewRawProducer(t testing.TB, brokers []string) *RawProducer {
	t.Helper()
	transport := &kafka.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	return &RawProducer{client: &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport, Timeout: 10 * time.Second}}
}

// Produce writes one record and returns where it landed.
func (p *RawProducer) Produce(ctx context.Context, topic, key string, value []byte) (Produced, error) {
	meta, err := p.client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return Produced{}, fmt.Errorf("metadata of %s: %w", topic, err)
	}
	if len(meta.Topics) != 1 || meta.Topics[0].Error != nil || len(meta.Topics[0].Partitions) == 0 {
		return Produced{}, fmt.Errorf("metadata of %s: %+v", topic, meta.Topics)
	}
	parts := make([]int, len(meta.Topics[0].Partitions))
	for i, tp := range meta.Topics[0].Partitions {
		parts[i] = tp.ID
	}
	partition := kafka.Murmur2Balancer{}.Balance(kafka.Message{Key: []byte(key)}, parts...)
	resp, err := p.client.Produce(ctx, &kafka.ProduceRequest{
		Topic: topic, Partition: partition, RequiredAcks: kafka.RequireAll,
		Records: kafka.NewRecordReader(kafka.Record{Key: kafka.NewBytes([]byte(key)), Value: kafka.NewBytes(value)}),
	})
	if err == nil {
		err = resp.Error
	}
	if err != nil {
		return Produced{}, fmt.Errorf("produce %d bytes to %s/%d: %w", len(value), topic, partition, err)
	}
	return Produced{Topic: topic, Partition: partition, Offset: resp.BaseOffset}, nil
}

// Valid is a valid record of a consumed topic, and how to see it applied.
type Valid struct {
	// Key and Value are the record's.
	Key   string
	Value []byte
	// Applied reports whether the service has applied the record.
	Applied func() bool
}

// PoisonTopic is one consumed topic of a running service, for RunPoison.
type PoisonTopic struct {
	// Topic is the consumed topic.
	Topic string
	// Addr is the service's HTTP address, whose /readyz must stay 200.
	Addr string
	// Brokers are the broker addresses.
	Brokers []string
	// Sample is a valid record of the topic; its truncation is a poison.
	Sample []byte
	// WrongSchema is a well-formed record of another schema.
	WrongSchema []byte
	// Next prepares a fresh valid record of the topic, keyed with a key
	// shorter than 64 bytes, without producing it.
	Next func(t *testing.T) Valid
	// DeadLetter returns the reason code the service dead-lettered the
	// record at with, or "" while it has not.
	DeadLetter func(t *testing.T, at Produced) string
}

// RunPoison checks the requirement on one consumed topic: a record
// of any bytes up to the broker's maximum size is dead-lettered with a
// reason, the service stays ready, and the next valid record is processed
// within seconds. It first waits for one valid record to be applied (the
// consumer group forms), then runs a subtest per PoisonRecords case that
// produces the poison under the next valid record's key (so on its
// partition) and that record after it, and fails unless, within
// PoisonDeadline, the poison is dead-lettered with a reason and the valid
// record applied, with /readyz answering 200 at every poll.
func RunPoison(t *testing.T, pt PoisonTopic) {
	t.Helper()
	ctx := context.Background()
	raw := NewRawProducer(t, pt.Brokers)
	warm := pt.Next(t)
	if _, err := raw.Produce(ctx, pt.Topic, warm.Key, warm.Value); err != nil {
		t.Fatal(err)
	}
	waitPoison(t, pt.Addr, "the warm-up record to be applied", warmUpLimit, warm.Applied)
	for i, name := range poisonNames {
		t.Run(name, func(t *testing.T) {
			next := pt.Next(t)
			p := PoisonRecords(t, len(next.Key), pt.Sample, pt.WrongSchema)[i]
			at, err := raw.Produce(ctx, pt.Topic, next.Key, p.Value)
			if err != nil {
				t.Fatal(err)
			}
			after, err := raw.Produce(ctx, pt.Topic, next.Key, next.Value)
			if err != nil {
				t.Fatal(err)
			}
			if after.Partition != at.Partition || after.Offset <= at.Offset {
				t.Fatalf("the valid record landed at %+v, not after the poison at %+v", after, at)
			}
			start := time.Now()
			reason := ""
			waitPoison(t, pt.Addr, fmt.Sprintf("the %d-byte poison at %s/%d/%d to be dead-lettered with a reason",
				len(p.Value), at.Topic, at.Partition, at.Offset), PoisonDeadline,
				func() bool { reason = pt.DeadLetter(t, at); return reason != "" })
			waitPoison(t, pt.Addr, "the valid record after the poison to be applied", PoisonDeadline-time.Since(start), next.Applied)
			t.Logf("dead-lettered (reason %s) and the next record applied in %s", reason, time.Since(start).Round(time.Millisecond))
		})
	}
}

// waitPoison polls cond every 20 ms until it holds, failing the test when
// limit passes first or when http://addr/readyz answers anything but 200.
func waitPoison(t *testing.T, addr, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if err := ready(addr); err != nil {
			t.Fatalf("waiting for %s: the service is not ready: %v", what, err)
		}
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", limit.Round(time.Millisecond), what)
		}
		<-tick.C
	}
}

// readyClient bounds one readiness probe.
var readyClient = &http.Client{Timeout: 2 * time.Second}

// ready returns nil when GET http://addr/readyz answers 200.
func ready(addr string) error {
	resp, err := readyClient.Get("http://" + addr + "/readyz")
	if err != nil {
		return fmt.Errorf("GET /readyz: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /readyz: %s: %s", resp.Status, body)
	}
	return nil
}
