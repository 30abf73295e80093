package sim

import (
	"context"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// Record is one Kafka record read by the simulator.
type Record struct {
	// Topic, Partition and Offset locate the record.
	Topic     string
	Partition int
	Offset    int64
	// Key is the record key.
	Key string
	// Value is the record value.
	Value []byte
	// Headers are the record headers.
	Headers map[string]string
}

// readerMaxWait bounds one fetch of the simulator's topic readers. A fetch
// returns as soon as a record arrives, so the wait only sets how often an
// idle partition is polled (the broker's CPU, which the mesh pays).
const readerMaxWait = bus.DefaultMaxWait

// topicOffsets returns, per partition of topic, its first offset (first) or
// the offset the next record will get.
func topicOffsets(ctx context.Context, brokers []string, sec bus.Security, topic string, first bool) (map[int]int64, error) {
	tr, err := sec.Transport()
	if err != nil {
		return nil, err
	}
	defer tr.CloseIdleConnections()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second, Transport: tr}
	meta, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("metadata of %s: %w", topic, err)
	}
	if len(meta.Topics) != 1 || meta.Topics[0].Error != nil {
		return nil, fmt.Errorf("metadata of %s: %v: %w", topic, meta.Topics, errNoTopic)
	}
	var reqs []kafka.OffsetRequest
	for _, p := range meta.Topics[0].Partitions {
		if first {
			reqs = append(reqs, kafka.FirstOffsetOf(p.ID))
		} else {
			reqs = append(reqs, kafka.LastOffsetOf(p.ID))
		}
	}
	res, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("offsets of %s: %w", topic, err)
	}
	out := map[int]int64{}
	for _, po := range res.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("offsets of %s/%d: %w", topic, po.Partition, po.Error)
		}
		if first {
			out[po.Partition] = po.FirstOffset
		} else {
			out[po.Partition] = po.LastOffset
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s has no partitions: %w", topic, errNoTopic)
	}
	return out, nil
}

func newPartitionReader(brokers []string, sec bus.Security, topic string, partition int, offset int64) (*kafka.Reader, error) {
	dialer, err := sec.Dialer()
	if err != nil {
		return nil, err
	}
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: brokers, Dialer: dialer, Topic: topic, Partition: partition,
		MinBytes: 1, MaxBytes: 16 << 20, MaxWait: readerMaxWait, ReadLagInterval: -1,
	})
	if err := r.SetOffset(offset); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("%s/%d offset %d: %w", topic, partition, offset, err)
	}
	return r, nil
}

func toRecord(m kafka.Message) Record {
	h := make(map[string]string, len(m.Headers))
	for _, kv := range m.Headers {
		h[kv.Key] = string(kv.Value)
	}
	return Record{Topic: m.Topic, Partition: m.Partition, Offset: m.Offset, Key: string(m.Key), Value: m.Value, Headers: h}
}

// tailTopic delivers the records of topic from the given offsets to fn, one
// goroutine per partition (fn must be safe for concurrent use), until ctx
// ends, connecting with sec. A reader that fails (the broker restarting) is reopened after the
// last record delivered, with backoff; tailTopic returns an error only when
// a partition's reads kept failing for bound. It returns nil when ctx ended.
func tailTopic(ctx context.Context, brokers []string, sec bus.Security, topic string, from map[int]int64, bound time.Duration, fn func(Record)) error {
	g, ctx := errgroup.WithContext(ctx)
	for p, off := range from {
		g.Go(func() error { return tailPartition(ctx, brokers, sec, topic, p, off, bound, fn) })
	}
	return g.Wait()
}

// healthyRead is how long a reader must have run before it failed for the
// failure to start a new outage rather than continue one: a reader of an
// unreachable broker fails within a few seconds.
const healthyRead = 10 * time.Second

// tailPartition is tailTopic's reader of one partition.
func tailPartition(ctx context.Context, brokers []string, sec bus.Security, topic string, p int, next int64, bound time.Duration, fn func(Record)) error {
	var failingSince time.Time
	failures := 0 // since the last record or healthy read
	for {
		opened := time.Now()
		err := readFrom(ctx, brokers, sec, topic, p, &next, func(m Record) {
			failingSince, failures = time.Time{}, 0
			fn(m)
		})
		if ctx.Err() != nil {
			return nil
		}
		now := time.Now()
		if now.Sub(opened) >= healthyRead {
			failingSince, failures = time.Time{}, 0 // it read (idle) for a while before failing
		}
		if failingSince.IsZero() {
			failingSince = now
		}
		if now.Sub(failingSince) >= bound {
			return fmt.Errorf("read %s/%d: failing for %v: %w", topic, p, bound, err)
		}
		failures++
		if retry.Sleep(ctx, retryBackoff.Delay(failures)) != nil {
			return nil
		}
	}
}

// readFrom reads partition p from *next, delivering every record to fn and
// advancing *next past it, until a read fails or ctx ends.
func readFrom(ctx context.Context, brokers []string, sec bus.Security, topic string, p int, next *int64, fn func(Record)) error {
	r, err := newPartitionReader(brokers, sec, topic, p, *next)
	if err != nil {
		return err
	}
	defer r.Close()
	for {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			return err
		}
		*next = m.Offset + 1
		fn(toRecord(m))
	}
}

// ReadAll returns every record of topic that the brokers hold when it is
// called, partition by partition in offset order, over plaintext without
// SASL (ReadAllWith for secured brokers).
func ReadAll(ctx context.Context, brokers []string, topic string) ([]Record, error) {
	return ReadAllWith(ctx, brokers, bus.Security{}, topic)
}

// ReadAllWith is ReadAll connecting with sec's TLS and SASL settings.
func ReadAllWith(ctx context.Context, brokers []string, sec bus.Security, topic string) ([]Record, error) {
	first, err := topicOffsets(ctx, brokers, sec, topic, true)
	if err != nil {
		return nil, err
	}
	last, err := topicOffsets(ctx, brokers, sec, topic, false)
	if err != nil {
		return nil, err
	}
	var out []Record
	for p, start := range first {
		recs, err := readRange(ctx, brokers, sec, topic, p, start, last[p])
		if err != nil {
			return nil, err
		}
		out = append(out, recs...)
	}
	return out, nil
}

// readRange reads the records of one partition in [start, end).
func readRange(ctx context.Context, brokers []string, sec bus.Security, topic string, p int, start, end int64) ([]Record, error) {
	if end <= start {
		return nil, nil
	}
	r, err := newPartitionReader(brokers, sec, topic, p, start)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	var out []Record
	for {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			return nil, fmt.Errorf("read %s/%d: %w", topic, p, err)
		}
		out = append(out, toRecord(m))
		if m.Offset >= end-1 {
			return out, nil
		}
	}
}
