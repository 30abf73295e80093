package sending_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

// TestBlockStoredRecordsInArrayForm: with KVEventsForm array the BlockStored
// records' events are vLLM's positional arrays, which llm-d-kv-cache
// v0.8.1's own adapter reads (hashes, parent, medium), each batch with
// data_parallel_rank 0.
func TestBlockStoredRecordsInArrayForm(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}),
		func(o *sending.Options) { o.KVEventsForm = contract.KVEventFormArray })
	f.handle(t, encode(t, saveTask(f.model, "kv1", 0, 64, 3)))
	recs, _ := f.kvRecords(t)
	values := f.outbox(t, contract.TopicKVEvents)
	if len(values) == 0 || len(values) != len(recs) {
		t.Fatalf("%d kv event records", len(values))
	}
	for i, v := range values {
		var raw []any
		if err := msgpack.Unmarshal(v, &raw); err != nil || len(raw) != 3 || raw[2] != int8(0) {
			t.Fatalf("record %d: batch %v (%v), want [ts, events, data_parallel_rank 0]", i, raw, err)
		}
		if _, ok := raw[1].([]any)[0].([]any); !ok {
			t.Fatalf("record %d: event is a %T, want a positional array", i, raw[1].([]any)[0])
		}
		_, _, b, err := engineadapter.NewVLLMAdapter().ParseMessage(&kvevents.RawMessage{Topic: "kv@p@" + f.model.Name, Payload: v})
		if err != nil {
			t.Fatalf("record %d: llm-d v0.8.1 refuses it: %v", i, err)
		}
		if len(b.Events) != len(recs[i].Batch.Events) {
			t.Fatalf("record %d: llm-d reads %d events, want %d", i, len(b.Events), len(recs[i].Batch.Events))
		}
		for j, e := range b.Events {
			want := recs[i].Batch.Events[j]
			got, ok := e.(*kvevents.BlockStoredEvent)
			if !ok || !slices.Equal(got.BlockHashes, want.BlockHashes) || got.DeviceTier != contract.MediumStore ||
				(want.ParentBlockHash != nil) != (got.ParentHash != 0) || got.LoraName != nil || len(got.Tokens) != 0 {
				t.Errorf("record %d event %d read by llm-d as %+v, want %+v", i, j, e, want)
			}
			if want.ParentBlockHash != nil && got.ParentHash != *want.ParentBlockHash {
				t.Errorf("record %d event %d: parent %#x, want %#x", i, j, got.ParentHash, *want.ParentBlockHash)
			}
		}
	}
}

// TestNewRefusesUnknownForm: a KV-event form other than map or array is
// refused.
func TestNewRefusesUnknownForm(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
	metrics, err := sending.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	_, err = sending.New(sending.Options{
		Model: f.model, Keys: f.keys, Store: f.store, Workers: engines{"e1": f.worker}, Ledger: f.ledger, Metrics: metrics,
		KVEventsForm: "positional",
	})
	if !errors.Is(err, sending.ErrOptions) || !errors.Is(err, contract.ErrKVEventForm) {
		t.Fatalf("New with form positional: %v, want ErrOptions and contract.ErrKVEventForm", err)
	}
}
