package kvpublish

import (
	"context"
	"encoding/binary"
	"errors"
	"reflect"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestPublishesLikeAVLLMPod: records written to Kafka by a kafka-go
// producer come out of the PUB socket as vLLM's frames [kv@<pod>@<model>,
// seq from 0, batch], re-encoded in the configured form; records of
// another model, deployment or tenant are skipped by reason, an
// undecodable one is counted and never stops the publisher.
func TestPublishesLikeAVLLMPod(t *testing.T) {
	r := newRig(t, func(o *Options) { o.Form = contract.KVEventFormArray })
	sub := r.subscribe()
	other := kvcore.KeyBuilder{Prefix: "dep", Model: "other"}
	r.produce(stored(testKeys, nil, []uint32{1, 2}, 11, 12))
	r.produceRaw(bus.Message{Topic: contract.TopicKVEvents, Key: "dep@org/model", Value: []byte("not msgpack"),
		Headers: map[string]string{contract.HeaderKVSchema: contract.SchemaKVEvent}})
	r.produce(
		stored(other, nil, nil, 13),
		stored(kvcore.KeyBuilder{Prefix: "dep2", Model: testKeys.Model}, nil, nil, 14),
		stored(testKeys.ForTenant("acme"), nil, nil, 15),
	)
	r.produceRaw(bus.Message{Topic: contract.TopicKVEvents, Key: "x", Value: mustBatch(t)}) // an engine's own batch, no kvmesh headers
	r.produce(removed(testKeys, 12))

	var got []contract.KVEventBatch
	for want := range int64(2) {
		f := recvFrames(t, sub)
		if len(f) != 3 || string(f[0]) != "kv@kvmesh-store@org/model" || seqOf(t, f[1]) != want {
			t.Fatalf("message %d: frames %s, want [kv@kvmesh-store@org/model, seq %d, batch]", want, describe(f), want)
		}
		checkArrayForm(t, f[2])
		b, err := contract.DecodeKVEventBatch(f[2])
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, b)
	}
	if e := got[0].Events[0]; e.Kind != contract.BlockStored || !reflect.DeepEqual(e.BlockHashes, []uint64{11, 12}) ||
		!reflect.DeepEqual(e.TokenIDs, []uint32{1, 2}) || e.Locality != nil || *got[0].DataParallelRank != 0 {
		t.Errorf("first batch %+v, want the BlockStored of 11, 12 with its tokens (array form: no locality)", got[0])
	}
	if e := got[1].Events[0]; e.Kind != contract.BlockRemoved || !reflect.DeepEqual(e.BlockHashes, []uint64{12}) {
		t.Errorf("second batch %+v, want the BlockRemoved of 12", got[1])
	}
	// The skipped and undecodable records are keyed apart from the
	// published ones, so they may sit on other partitions and be read
	// after both batches came out; and a batch is counted published just
	// after its send: wait for the counts.
	skips := map[string]float64{SkipModel: 1, SkipDeployment: 1, SkipTenant: 1, SkipForeign: 1}
	until(t, "every published, skipped and undecodable record counted", func() bool {
		for reason, want := range skips {
			if testutil.ToFloat64(r.metrics.skipped.WithLabelValues(reason)) < want {
				return false
			}
		}
		return testutil.ToFloat64(r.metrics.decodeFailures) >= 1 && testutil.ToFloat64(r.metrics.published) >= 2
	})
	for reason, want := range skips {
		if n := testutil.ToFloat64(r.metrics.skipped.WithLabelValues(reason)); n != want {
			t.Errorf("skipped{reason=%s} = %v, want %v", reason, n, want)
		}
	}
	if n := testutil.ToFloat64(r.metrics.decodeFailures); n != 1 {
		t.Errorf("decode failures %v, want 1", n)
	}
	if n := testutil.ToFloat64(r.metrics.published); n != 2 {
		t.Errorf("published %v, want 2", n)
	}
}

// mustBatch is a vLLM batch without kvmesh's headers.
func mustBatch(t *testing.T) []byte {
	t.Helper()
	v, err := contract.EncodeKVEventBatch(contract.KVEventBatch{TS: 1, Events: []contract.KVEvent{{Kind: contract.AllBlocksCleared}}}, contract.KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// checkArrayForm checks that every event of a batch is a positional array.
func checkArrayForm(t *testing.T, payload []byte) {
	t.Helper()
	b, err := contract.DecodeKVEventBatch(payload)
	if err != nil {
		t.Fatal(err)
	}
	want, err := contract.EncodeKVEventBatch(b, contract.KVEventFormArray)
	if err != nil {
		t.Fatal(err)
	}
	if string(want) != string(payload) {
		t.Fatalf("payload is not the array form of its batch")
	}
}

// TestTenantPublisherAndClear: a tenant's publisher publishes only that
// tenant's key space, plus the deployment's AllBlocksCleared; the map form
// is the default.
func TestTenantPublisherAndClear(t *testing.T) {
	r := newRig(t, func(o *Options) { o.Tenant = "acme"; o.Pod = "store-acme" })
	sub := r.subscribe()
	r.produce(stored(testKeys, nil, nil, 1), stored(testKeys.ForTenant("acme"), nil, nil, 2))
	r.produce(contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: 2, Events: []contract.KVEvent{{Kind: contract.AllBlocksCleared}}},
		Model: testKeys.Model, Namespace: "dep@org/model", Cause: "flushed",
	})
	kinds := map[contract.KVEventKind]uint64{}
	for range 2 {
		f := recvFrames(t, sub)
		if string(f[0]) != "kv@store-acme@org/model" {
			t.Fatalf("topic %q", f[0])
		}
		b, err := contract.DecodeKVEventBatch(f[2])
		if err != nil {
			t.Fatal(err)
		}
		e := b.Events[0]
		if e.Kind == contract.BlockStored && (e.BlockHashes[0] != 2 || e.Locality == nil) {
			t.Errorf("BlockStored %+v, want the tenant's block 2 in the map form (with locality)", e)
		}
		kinds[e.Kind]++
	}
	if kinds[contract.BlockStored] != 1 || kinds[contract.AllBlocksCleared] != 1 {
		t.Errorf("published %v, want the tenant's BlockStored and the AllBlocksCleared", kinds)
	}
	if n := testutil.ToFloat64(r.metrics.skipped.WithLabelValues(SkipTenant)); n != 1 {
		t.Errorf("skipped{tenant} = %v, want 1 (the tenant-less block)", n)
	}
}

// replayFrom asks the ROUTER for the batches from start on (a DEALER
// sends ["", start]) and returns the replies, the end marker's included.
func replayFrom(t *testing.T, addr string, start uint64) [][][]byte {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	d := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("replayer")))
	defer func() { _ = d.Close(); cancel() }()
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(nil, binary.BigEndian.AppendUint64(nil, start))); err != nil {
		t.Fatal(err)
	}
	var out [][][]byte
	for {
		f := recvFrames(t, d)
		out = append(out, f)
		if len(f) >= 3 && len(f[len(f)-2]) == 8 && seqOf(t, f[len(f)-2]) == -1 {
			return out
		}
	}
}

// TestReplay: the ROUTER answers a start seq with every kept batch from it
// on, then END_SEQ (-1), in vLLM's framing; the buffer keeps the last
// BufferSteps batches.
func TestReplay(t *testing.T) {
	for _, framing := range []ReplayFraming{FramingTopic, FramingSeq} {
		t.Run(string(framing), func(t *testing.T) {
			r := newRig(t, func(o *Options) { o.BufferSteps = 3; o.ReplayFraming = framing })
			for w := range uint64(5) {
				r.produce(stored(testKeys, nil, nil, 100+w))
			}
			until(t, "5 batches published", func() bool { return testutil.ToFloat64(r.metrics.published) == 5 })
			replies := replayFrom(t, r.p.ReplayAddr(), 1) // 0 and 1 are out of the buffer; 2, 3, 4 remain
			if len(replies) != 4 {
				t.Fatalf("%d replies, want 3 batches and the end marker", len(replies))
			}
			for i, f := range replies {
				checkReply(t, framing, f, i == 3, int64(i+2))
			}
			if n := testutil.ToFloat64(r.metrics.replays); n != 1 {
				t.Errorf("replay requests %v, want 1", n)
			}
		})
	}
}

// checkReply checks one replay reply as the DEALER gets it (the ROUTER's
// client id stripped): ["", topic, seq, payload] or ["", seq, payload],
// the end marker ["", "", -1, ""] or ["", -1, ""].
func checkReply(t *testing.T, framing ReplayFraming, f [][]byte, end bool, seq int64) {
	t.Helper()
	want := 4
	if framing == FramingSeq {
		want = 3
	}
	if len(f) != want || len(f[0]) != 0 {
		t.Fatalf("reply %s: want %d frames after the client id, the first empty", describe(f), want)
	}
	if framing == FramingTopic {
		topic := "kv@kvmesh-store@org/model"
		if end {
			topic = ""
		}
		if string(f[1]) != topic {
			t.Fatalf("reply %s: topic frame %q, want %q", describe(f), f[1], topic)
		}
	}
	gotSeq, payload := seqOf(t, f[len(f)-2]), f[len(f)-1]
	if end {
		if gotSeq != -1 || len(payload) != 0 {
			t.Fatalf("end marker %s, want seq -1 and an empty payload", describe(f))
		}
		return
	}
	b, err := contract.DecodeKVEventBatch(payload)
	if gotSeq != seq || err != nil || b.Events[0].BlockHashes[0] != uint64(100+seq) {
		t.Fatalf("reply %d: seq %d, batch %+v (%v)", seq, gotSeq, b, err)
	}
}

// TestOptionsRefused: New refuses options that cannot work, each with
// ErrOptions.
func TestOptionsRefused(t *testing.T) {
	r := newRig(t, nil)
	base := Options{Keys: testKeys, Endpoint: "tcp://127.0.0.1:0", Metrics: r.metrics}
	for name, tweak := range map[string]func(*Options){
		"no endpoint":   func(o *Options) { o.Endpoint = "" },
		"bad tenant":    func(o *Options) { o.Tenant = "a b" },
		"bad form":      func(o *Options) { o.Form = "list" },
		"bad framing":   func(o *Options) { o.ReplayFraming = "frames" },
		"no metrics":    func(o *Options) { o.Metrics = nil },
		"negative size": func(o *Options) { o.BufferSteps = -1 },
	} {
		o := base
		tweak(&o)
		if _, err := New(o); !errors.Is(err, ErrOptions) {
			t.Errorf("%s: %v, want ErrOptions", name, err)
		}
	}
	o := base
	o.Endpoint = "tcp://" + r.p.Addr() // taken
	if _, err := New(o); err == nil {
		t.Error("New bound an endpoint already bound")
	}
}

// TestStopsWithoutReplay: a publisher without a replay endpoint has no
// replay address and still stops when its context ends: newRig's cleanup
// fails the test unless Run returns nil within 10 s.
func TestStopsWithoutReplay(t *testing.T) {
	r := newRig(t, func(o *Options) { o.ReplayEndpoint = "" })
	if r.p.ReplayAddr() != "" {
		t.Error("a replay address without a replay endpoint")
	}
}

// TestRepublishesFromTheEarliestRecord: Kafka is the durable source: a
// publisher started after records were written publishes them from the
// topic's earliest offset, and a restarted one publishes them all again
// from seq 0.
func TestRepublishesFromTheEarliestRecord(t *testing.T) {
	b := newBroker(t)
	b.produce(stored(testKeys, nil, nil, 100), stored(testKeys, nil, nil, 101))
	for run := range 2 {
		r := b.publisher(nil)
		until(t, "the earlier records published", func() bool { return testutil.ToFloat64(r.metrics.published) == 2 })
		replies := replayFrom(t, r.p.ReplayAddr(), 0)
		if len(replies) != 3 {
			t.Fatalf("run %d: %d replies, want the 2 records and the end marker", run, len(replies))
		}
		for i, f := range replies {
			checkReply(t, FramingTopic, f, i == 2, int64(i))
		}
		r.stop()
	}
}
