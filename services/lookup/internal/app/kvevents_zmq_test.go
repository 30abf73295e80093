package app_test

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestKVEventsZMQPublisher: with KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT set,
// the lookup runs the publisher as one of its tasks: a BlockStored record
// of its deployment written to kvmesh.kv.events is answered by a replay
// from seq 0 as batch 0 on topic kv@<pod>@<model>, in the array form; off
// by default (startApp's lookup has no address).
func TestKVEventsZMQPublisher(t *testing.T) {
	env := servicetest.NewEnv(t)
	s := startLookup(t, env, map[string]string{
		"KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT":        "tcp://127.0.0.1:0",
		"KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_ENDPOINT": "tcp://127.0.0.1:0",
		"KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM":            "array",
		"KVMESH_LOOKUP_KV_EVENTS_ZMQ_POD":             "store-a",
	})
	if s.kvZMQ == "" || s.kvReplay == "" {
		t.Fatal("no publisher address with the endpoint set")
	}
	produceStored(t, env.Brokers, s.keys(), 0xfeed)
	var frames [][]byte
	eventually(t, "the BlockStored replayed from seq 0", func() bool {
		frames = replayFirst(t, s.kvReplay)
		return frames != nil
	})
	if string(frames[1]) != "kv@store-a@"+s.model.Name || binary.BigEndian.Uint64(frames[2]) != 0 {
		t.Fatalf("replayed frames topic %q seq %x, want kv@store-a@%s and 0", frames[1], frames[2], s.model.Name)
	}
	b, err := contract.DecodeKVEventBatch(frames[3])
	if err != nil || b.Events[0].BlockHashes[0] != 0xfeed || b.Events[0].Locality != nil {
		t.Fatalf("replayed batch %+v (%v), want the BlockStored of 0xfeed in the array form", b, err)
	}
	if off := startLookup(t, env, nil); off.kvZMQ != "" {
		t.Errorf("publisher address %q with the endpoint unset", off.kvZMQ)
	}
}

// produceStored writes one BlockStored record of kb's group 0.
func produceStored(t *testing.T, brokers []string, kb kvcore.KeyBuilder, wire uint64) {
	t.Helper()
	p, err := bus.NewProducer(brokers)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.Close() }()
	h := kvcore.BlockHash(binary.BigEndian.AppendUint64(nil, wire))
	medium := contract.MediumStore
	key, value, headers, err := contract.EncodeKVEventRecord(contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: 1, Events: []contract.KVEvent{{
			Kind: contract.BlockStored, BlockHashes: []uint64{wire}, BlockSize: 16, Medium: &medium,
		}}},
		Model: kb.Model, Namespace: kb.Namespace(kvcore.Rank{}, 0), Hashes: []string{h.Hex()},
	}, contract.KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Publish(ctx, bus.Message{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers}); err != nil {
		t.Fatal(err)
	}
}

// replayFirst asks the replay socket for everything from seq 0 and returns
// the first reply ["", topic, seq, payload], or nil when the buffer was
// empty (the first reply is the end marker).
func replayFirst(t *testing.T, addr string) [][]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("app-test")))
	defer func() { _ = d.Close() }()
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(nil, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	m, err := d.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Frames) != 4 {
		t.Fatalf("replay reply of %d frames, want 4", len(m.Frames))
	}
	if int64(binary.BigEndian.Uint64(m.Frames[2])) == -1 {
		return nil
	}
	return m.Frames
}
