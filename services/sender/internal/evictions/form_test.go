package evictions

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestArrayFormRecords: with Form array the watcher's BlockRemoved and
// AllBlocksCleared records are vLLM's positional events, which
// llm-d-kv-cache v0.8.1's own adapter reads, each batch with
// data_parallel_rank 0.
func TestArrayFormRecords(t *testing.T) {
	r := newRig(t, nil, func(o *Options) { o.MarkerEvery = 50 * time.Millisecond; o.Form = contract.KVEventFormArray })
	r.waitReady()
	ctx := context.Background()
	h := kvcore.BlockHash{4, 5, 6}
	key := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}.Key(kvcore.Rank{}, 0, h)
	if err := r.client.Set(ctx, key, "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := r.client.Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	r.until("BlockRemoved of the deleted key", func() bool { return r.removed()[key] == CauseDeleted })
	eventually(t, "the marker key set", func() bool { return r.client.Exists(ctx, r.w.single.marker).Val() == 1 })
	if err := r.client.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	r.until("AllBlocksCleared after FLUSHALL", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.records[len(r.records)-1].Kind() == contract.AllBlocksCleared
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[kvevents.EventType]int{}
	for i, v := range r.values {
		checkRankZero(t, v)
		_, _, b, err := engineadapter.NewVLLMAdapter().ParseMessage(&kvevents.RawMessage{Topic: "kv@p@m", Payload: v})
		if err != nil {
			t.Fatalf("record %d (%s): llm-d v0.8.1 refuses it: %v", i, r.records[i].Kind(), err)
		}
		for _, e := range b.Events {
			seen[e.Type()]++
			if rm, ok := e.(*kvevents.BlockRemovedEvent); ok &&
				(len(rm.BlockHashes) != 1 || rm.BlockHashes[0] != contract.WireHash(h) || rm.DeviceTier != contract.MediumStore) {
				t.Errorf("BlockRemoved read by llm-d %+v, want hash %#x on %s", rm, contract.WireHash(h), contract.MediumStore)
			}
		}
	}
	if seen[kvevents.EventTypeBlockRemoved] != 1 || seen[kvevents.EventTypeAllBlocksCleared] != 1 {
		t.Errorf("events read by llm-d %v, want one BlockRemoved and one AllBlocksCleared", seen)
	}
}

// checkRankZero checks that a record value is [ts, events, 0].
func checkRankZero(t *testing.T, value []byte) {
	t.Helper()
	var b []any
	if err := msgpack.Unmarshal(value, &b); err != nil {
		t.Fatal(err)
	}
	if len(b) != 3 || b[2] != int8(0) {
		t.Errorf("batch %v: want [ts, events, data_parallel_rank 0]", b)
	}
}

// TestNewRefusesUnknownForm: a form other than map or array is refused.
func TestNewRefusesUnknownForm(t *testing.T) {
	_, err := New(Options{Keys: kvcore.KeyBuilder{Model: "m"}, Publisher: nopPublisher{}, Metrics: &Metrics{}, Form: "list"})
	if !errors.Is(err, ErrOptions) || !errors.Is(err, contract.ErrKVEventForm) {
		t.Fatalf("New with form list: %v, want ErrOptions and contract.ErrKVEventForm", err)
	}
}
