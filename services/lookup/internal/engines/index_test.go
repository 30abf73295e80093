package engines

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func ptr[T any](v T) *T { return &v }

func stored(group *int, hashes ...uint64) contract.KVEvent {
	return contract.KVEvent{Kind: contract.BlockStored, GroupIdx: group, BlockHashes: hashes}
}

func removed(group *int, hashes ...uint64) contract.KVEvent {
	return contract.KVEvent{Kind: contract.BlockRemoved, GroupIdx: group, BlockHashes: hashes}
}

// held lists, per engine, the sets of groups 0 and 1 as sorted hash lists.
func held(x *Index) map[string][2][]uint64 {
	out := map[string][2][]uint64{}
	x.Each(func(engine string, has Presence) {
		var sets [2][]uint64
		for g := range sets {
			for h := uint64(1); h <= 9; h++ {
				if has(g, h) {
					sets[g] = append(sets[g], h)
				}
			}
		}
		out[engine] = sets
	})
	return out
}

func TestIndexApply(t *testing.T) {
	cases := []struct {
		name    string
		batches map[string][]contract.KVEvent // applied in engine order a, b
		want    map[string][2][]uint64
		wantErr error
	}{
		{"stored to its group; no group is group 0",
			map[string][]contract.KVEvent{"a": {stored(ptr(1), 1, 2), stored(nil, 3)}},
			map[string][2][]uint64{"a": {{3}, {1, 2}}}, nil},
		{"removed from its group only",
			map[string][]contract.KVEvent{"a": {stored(ptr(0), 1, 2), stored(ptr(1), 1, 2), removed(ptr(1), 1)}},
			map[string][2][]uint64{"a": {{1, 2}, {2}}}, nil},
		{"removed without a group: from every group",
			map[string][]contract.KVEvent{"a": {stored(ptr(0), 1, 2), stored(ptr(1), 1, 2), removed(nil, 2)}},
			map[string][2][]uint64{"a": {{1}, {1}}}, nil},
		{"all blocks cleared empties that engine only",
			map[string][]contract.KVEvent{"a": {stored(ptr(0), 1), {Kind: contract.AllBlocksCleared}, stored(ptr(1), 4)}, "b": {stored(ptr(0), 5)}},
			map[string][2][]uint64{"a": {nil, {4}}, "b": {{5}, nil}}, nil},
		{"other media are ignored",
			map[string][]contract.KVEvent{"a": {stored(ptr(0), 1), {Kind: contract.BlockStored, BlockHashes: []uint64{2}, Medium: ptr("CPU")}, {Kind: contract.BlockRemoved, BlockHashes: []uint64{1}, Medium: ptr("CPU")}, {Kind: contract.BlockStored, BlockHashes: []uint64{3}, Medium: ptr(MediumGPU)}}},
			map[string][2][]uint64{"a": {{1, 3}, nil}}, nil},
		{"an unknown group is an error, the rest applied",
			map[string][]contract.KVEvent{"a": {stored(ptr(2), 1), stored(ptr(0), 6)}},
			map[string][2][]uint64{"a": {{6}, nil}}, ErrGroup},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x := NewIndex(2)
			var err error
			for _, e := range []string{"a", "b"} {
				if evs, ok := tc.batches[e]; ok {
					err = errors.Join(err, x.Apply(e, contract.KVEventBatch{Events: evs}))
				}
			}
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("Apply = %v, want %v", err, tc.wantErr)
			}
			if got := held(x); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("held %v, want %v", got, tc.want)
			}
		})
	}
}

func TestIndexHandle(t *testing.T) {
	batch, err := contract.EncodeKVEventBatch(contract.KVEventBatch{Events: []contract.KVEvent{stored(ptr(0), 7)}}, contract.KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	long := string(make([]byte, MaxEngineIDBytes+1))
	cases := []struct {
		name    string
		value   []byte
		headers map[string]string
		reason  kvcore.Reason // "" for a record handled without error
		held    bool          // whether engine e holds 7 afterwards
	}{
		{"an engine's own batch", batch, map[string]string{contract.HeaderKVEngineID: "e"}, "", true},
		{"kvmesh's store events are skipped", batch, map[string]string{contract.HeaderKVEngineID: "e", contract.HeaderKVSchema: contract.SchemaKVEvent}, "", false},
		{"no engine id is skipped", batch, map[string]string{}, "", false},
		{"an undecodable batch", []byte{0xc1}, map[string]string{contract.HeaderKVEngineID: "e"}, kvcore.ReasonUndecodable, false},
		{"an over-long engine id", batch, map[string]string{contract.HeaderKVEngineID: long}, kvcore.ReasonBadEngineID, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			x := NewIndex(1)
			err := x.Handle(context.Background(), bus.Received{Message: bus.Message{Topic: contract.TopicKVEvents, Value: tc.value, Headers: tc.headers}})
			var pe *bus.PermanentError
			switch {
			case tc.reason == "" && err != nil:
				t.Fatalf("Handle = %v, want nil", err)
			case tc.reason != "" && (!errors.As(err, &pe) || pe.Reason != tc.reason):
				t.Fatalf("Handle = %v, want a permanent %s", err, tc.reason)
			}
			got := false
			x.Each(func(engine string, has Presence) { got = got || engine == "e" && has(0, 7) })
			if got != tc.held {
				t.Fatalf("engine e holds block 7: %v, want %v", got, tc.held)
			}
		})
	}
}
