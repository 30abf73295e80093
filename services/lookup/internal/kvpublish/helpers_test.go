package kvpublish

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// testKeys is the deployment of the tests.
var testKeys = kvcore.KeyBuilder{Prefix: "dep", Model: "org/model"}

// broker is a kfake broker over TCP and a kafka-go producer onto it.
type broker struct {
	t        *testing.T
	addrs    []string
	producer *bus.Producer
}

// newBroker starts the broker (2 partitions a topic) and the producer;
// both stop at the test's end.
func newBroker(t *testing.T) *broker {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	p, err := bus.NewProducer(b.Addrs())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return &broker{t: t, addrs: b.Addrs(), producer: p}
}

// rig is a broker and a publisher fed from it.
type rig struct {
	*broker
	metrics *Metrics
	p       *Publisher
	stop    func() // stops the publisher and its consumer and checks both returned nil
}

// newRig starts a broker and a publisher bound to loopback ports, with
// opts changed by tweak; the publisher stops at the test's end and must
// return nil.
func newRig(t *testing.T, tweak func(*Options)) *rig {
	t.Helper()
	return newBroker(t).publisher(tweak)
}

// groups numbers the rigs' consumer groups: each publisher reads the topic
// from its oldest record, as the lookup's own group does.
var groups atomic.Int64

// publisher starts a publisher, with opts changed by tweak, and a consumer
// of kvmesh.kv.events on b that hands it every record (Publisher.Handle),
// as the lookup wires it.
func (b *broker) publisher(tweak func(*Options)) *rig {
	t := b.t
	t.Helper()
	r := &rig{broker: b}
	var err error
	if r.metrics, err = NewMetrics(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	opts := Options{
		Keys: testKeys, Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0",
		Metrics: r.metrics, Logger: slog.New(slog.DiscardHandler),
	}
	if tweak != nil {
		tweak(&opts)
	}
	if r.p, err = New(opts); err != nil {
		t.Fatal(err)
	}
	c, err := bus.NewConsumer(bus.ConsumerConfig{
		Brokers: b.addrs, GroupID: fmt.Sprintf("kvpublish-test-%d", groups.Add(1)), Topics: []string{contract.TopicKVEvents},
		MaxWait: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
		// The lookup logs and skips a record Handle refuses; so does the rig.
		OnDeadLetter: func(context.Context, bus.Received, kvcore.Reason, error) error { return nil },
	}, r.p.Handle)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- r.p.Run(ctx) }()
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	r.stop = func() {
		once.Do(func() {
			cancel()
			for range 2 {
				select {
				case err := <-done:
					if err != nil {
						t.Errorf("Run: %v", err)
					}
				case <-time.After(10 * time.Second):
					t.Error("the publisher or its consumer did not return within 10 s of its context ending")
				}
			}
		})
	}
	t.Cleanup(r.stop)
	return r
}

// produce writes records onto kvmesh.kv.events.
func (b *broker) produce(recs ...contract.KVEventRecord) {
	b.t.Helper()
	var msgs []bus.Message
	for _, rec := range recs {
		key, value, headers, err := contract.EncodeKVEventRecord(rec, contract.KVEventFormMap)
		if err != nil {
			b.t.Fatal(err)
		}
		msgs = append(msgs, bus.Message{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers})
	}
	b.produceRaw(msgs...)
}

func (b *broker) produceRaw(msgs ...bus.Message) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.producer.Publish(ctx, msgs...); err != nil {
		b.t.Fatal(err)
	}
}

// blockHash is an 8-byte store hash whose wire hash is w.
func blockHash(w uint64) kvcore.BlockHash {
	return binary.BigEndian.AppendUint64(nil, w)
}

// stored is a BlockStored record of kb's group-0 namespace: one event of
// the blocks with wire hashes ws, their tokens and parent.
func stored(kb kvcore.KeyBuilder, parent *uint64, tokens []uint32, ws ...uint64) contract.KVEventRecord {
	medium, locality := contract.MediumStore, contract.LocalityStore
	rec := contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: 1, Events: []contract.KVEvent{{
			Kind: contract.BlockStored, BlockHashes: ws, ParentBlockHash: parent, TokenIDs: tokens, BlockSize: 16,
			Medium: &medium, GroupIdx: new(int), SpecKind: "full_attention", Locality: &locality,
		}}},
		Model: kb.Model, Namespace: kb.Namespace(kvcore.Rank{}, 0), Tenant: kb.Tenant,
	}
	for _, w := range ws {
		rec.Hashes = append(rec.Hashes, blockHash(w).Hex())
	}
	return rec
}

// removed is a BlockRemoved record of kb's group-0 namespace.
func removed(kb kvcore.KeyBuilder, ws ...uint64) contract.KVEventRecord {
	rec := stored(kb, nil, nil, ws...)
	medium := contract.MediumStore
	rec.Batch.Events = []contract.KVEvent{{Kind: contract.BlockRemoved, BlockHashes: ws, Medium: &medium, GroupIdx: new(int)}}
	rec.Cause = "del"
	return rec
}

// until polls cond until it holds, failing the test after 20 s.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, what, cond)
}

// subscribe connects a SUB socket to the publisher with filter "kv@" and
// waits until the publisher sees the subscription.
func (r *rig) subscribe() zmq4.Socket {
	r.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	r.t.Cleanup(func() { _ = sub.Close(); cancel() })
	if err := sub.Dial("tcp://" + r.p.Addr()); err != nil {
		r.t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		r.t.Fatal(err)
	}
	until(r.t, "the subscription at the publisher", r.topics())
	return sub
}

// topics reports whether the publisher has a subscription to "kv@".
func (r *rig) topics() func() bool {
	topics, _ := r.p.pub.(zmq4.Topics)
	return func() bool { return slices.Contains(topics.Topics(), "kv@") }
}

// recvFrames receives one message within 20 s.
func recvFrames(t *testing.T, s zmq4.Socket) [][]byte {
	t.Helper()
	type result struct {
		msg zmq4.Msg
		err error
	}
	ch := make(chan result, 1)
	go func() { m, err := s.Recv(); ch <- result{m, err} }()
	select {
	case res := <-ch:
		if res.err != nil {
			t.Fatal(res.err)
		}
		return res.msg.Frames
	case <-time.After(20 * time.Second):
		t.Fatal("no message in 20 s")
	}
	return nil
}

// seqOf reads an 8-byte big-endian seq frame.
func seqOf(t *testing.T, b []byte) int64 {
	t.Helper()
	if len(b) != 8 {
		t.Fatalf("seq frame of %d bytes, want 8", len(b))
	}
	return int64(binary.BigEndian.Uint64(b))
}

func describe(frames [][]byte) string {
	out := make([]string, len(frames))
	for i, f := range frames {
		out[i] = fmt.Sprintf("%q", f)
	}
	return fmt.Sprint(out)
}
