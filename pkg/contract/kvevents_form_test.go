package contract

import (
	"errors"
	"reflect"
	"slices"
	"testing"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"github.com/vmihailenco/msgpack/v5"
)

// llmdTopic is a vLLM pod's ZMQ topic, kv@<pod>@<model>.
const llmdTopic = "kv@kvmesh-store@org/model"

// llmdParse decodes value as llm-d-kv-cache v0.8.1 does: its own
// VLLMAdapter.ParseMessage on a message of llmdTopic.
func llmdParse(value []byte) (kvevents.EventBatch, error) {
	pod, model, b, err := engineadapter.NewVLLMAdapter().ParseMessage(&kvevents.RawMessage{Topic: llmdTopic, Payload: value})
	if err == nil && (pod != "kvmesh-store" || model != "org/model") {
		err = errors.New("topic read as pod " + pod + ", model " + model)
	}
	return b, err
}

// fullStored is a BlockStored event with every field set.
func fullStored() KVEvent {
	return KVEvent{
		Kind: BlockStored, BlockHashes: []uint64{11, 1 << 63, 13}, ParentBlockHash: ptr(uint64(7)),
		TokenIDs: []uint32{1, 2, 3, 70000}, BlockSize: 16, LoraID: ptr(3), LoraName: ptr("adapter"),
		Medium: ptr(MediumStore), ExtraKeys: []any{[]any{"salt"}, nil, []any{"mm", int8(1)}},
		GroupIdx: ptr(1), SpecKind: specSlidingWindow, SlidingWindow: ptr(128), Locality: ptr(LocalityStore),
	}
}

// TestArrayFormDecodesWithLLMD: llm-d-kv-cache v0.8.1's own adapter reads
// every field of array-form events.
func TestArrayFormDecodesWithLLMD(t *testing.T) {
	b := KVEventBatch{TS: 12.5, DataParallelRank: ptr(0), Events: []KVEvent{
		fullStored(),
		{Kind: BlockRemoved, BlockHashes: []uint64{13, 11}, Medium: ptr(MediumStore), GroupIdx: ptr(1), Locality: ptr(LocalityStore)},
		{Kind: AllBlocksCleared},
	}}
	value, err := EncodeKVEventBatch(b, KVEventFormArray)
	if err != nil {
		t.Fatal(err)
	}
	got, err := llmdParse(value)
	if err != nil {
		t.Fatalf("llm-d v0.8.1 refuses the array form: %v", err)
	}
	if got.Timestamp != 12.5 || len(got.Events) != 3 {
		t.Fatalf("batch ts %v, %d events", got.Timestamp, len(got.Events))
	}
	stored, ok := got.Events[0].(*kvevents.BlockStoredEvent)
	if !ok {
		t.Fatalf("event 0 is a %T", got.Events[0])
	}
	want := &kvevents.BlockStoredEvent{
		BlockHashes: []uint64{11, 1 << 63, 13}, Tokens: []uint32{1, 2, 3, 70000}, ParentHash: 7,
		DeviceTier: MediumStore, LoraID: ptr(3), LoraName: ptr("adapter"),
		ExtraKeys: [][]any{{"salt"}, nil, {"mm", int8(1)}},
	}
	if !reflect.DeepEqual(stored, want) {
		t.Fatalf("BlockStored read by llm-d\n%#v\nwant\n%#v", stored, want)
	}
	removed, ok := got.Events[1].(*kvevents.BlockRemovedEvent)
	if !ok || !slices.Equal(removed.BlockHashes, []uint64{13, 11}) || removed.DeviceTier != MediumStore {
		t.Fatalf("BlockRemoved read by llm-d: %#v", got.Events[1])
	}
	if _, ok := got.Events[2].(*kvevents.AllBlocksClearedEvent); !ok {
		t.Fatalf("event 2 is a %T", got.Events[2])
	}
}

// TestArrayFormKVMeshEventsDecodeWithLLMD: the events kvmesh itself
// produces (no LoRA, no parent, no tokens in the sender's records) read
// with nil and empty fields where kvmesh leaves them unset.
func TestArrayFormKVMeshEventsDecodeWithLLMD(t *testing.T) {
	e := KVEvent{
		Kind: BlockStored, BlockHashes: []uint64{5}, TokenIDs: []uint32{}, BlockSize: 16,
		Medium: ptr(MediumStore), GroupIdx: ptr(0), SpecKind: specFullAttention, Locality: ptr(LocalityStore),
	}
	value, err := EncodeKVEventBatch(KVEventBatch{TS: 1, DataParallelRank: ptr(0), Events: []KVEvent{e}}, KVEventFormArray)
	if err != nil {
		t.Fatal(err)
	}
	got, err := llmdParse(value)
	if err != nil {
		t.Fatal(err)
	}
	want := &kvevents.BlockStoredEvent{BlockHashes: []uint64{5}, Tokens: []uint32{}, DeviceTier: MediumStore}
	if !reflect.DeepEqual(got.Events[0], want) {
		t.Fatalf("read by llm-d %#v, want %#v", got.Events[0], want)
	}
}

// rawArrayEvents decodes an array-form batch's events as plain lists.
func rawArrayEvents(t *testing.T, value []byte) [][]any {
	t.Helper()
	var b []any
	if err := msgpack.Unmarshal(value, &b); err != nil {
		t.Fatal(err)
	}
	if len(b) != 3 {
		t.Fatalf("batch of %d fields, want [ts, events, data_parallel_rank]", len(b))
	}
	var out [][]any
	for _, e := range b[1].([]any) {
		l, ok := e.([]any)
		if !ok {
			t.Fatalf("event is a %T, want a positional array", e)
		}
		out = append(out, l)
	}
	return out
}

// TestArrayFormOmitDefaults: as msgspec's omit_defaults with array_like,
// only a trailing run of unset defaulted fields is left off; an unset one
// before a set one is written as nil, and locality never has a position.
func TestArrayFormOmitDefaults(t *testing.T) {
	tests := []struct {
		name  string
		event KVEvent
		want  []any
	}{
		{"stored, no defaulted field", KVEvent{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{}, BlockSize: 16, Locality: ptr("REMOTE")},
			[]any{"BlockStored", []any{int8(1)}, nil, []any{}, int8(16), nil, nil, nil}},
		{"stored, group set after unset extra_keys", KVEvent{Kind: BlockStored, BlockHashes: []uint64{1}, BlockSize: 16, GroupIdx: ptr(2)},
			[]any{"BlockStored", []any{int8(1)}, nil, []any{}, int8(16), nil, nil, nil, nil, int8(2)}},
		{"stored, window last", KVEvent{Kind: BlockStored, BlockHashes: []uint64{1}, BlockSize: 16, SlidingWindow: ptr(64)},
			[]any{"BlockStored", []any{int8(1)}, nil, []any{}, int8(16), nil, nil, nil, nil, nil, nil, int8(64)}},
		{"removed, no group", KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{1}, Locality: ptr("REMOTE")},
			[]any{"BlockRemoved", []any{int8(1)}, nil}},
		{"removed, group", KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{1}, Medium: ptr("CPU"), GroupIdx: ptr(0)},
			[]any{"BlockRemoved", []any{int8(1)}, "CPU", int8(0)}},
		{"cleared", KVEvent{Kind: AllBlocksCleared}, []any{"AllBlocksCleared"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			value, err := EncodeKVEventBatch(KVEventBatch{TS: 1, DataParallelRank: ptr(0), Events: []KVEvent{tc.event}}, KVEventFormArray)
			if err != nil {
				t.Fatal(err)
			}
			got := rawArrayEvents(t, value)[0]
			if !reflect.DeepEqual(normalizeInts(got), normalizeInts(tc.want)) {
				t.Fatalf("event on the wire %#v\nwant %#v", got, tc.want)
			}
		})
	}
}

// normalizeInts turns every integer into an int64, so the test does not
// depend on the msgpack integer width the encoder picks.
func normalizeInts(v any) any {
	switch x := v.(type) {
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = normalizeInts(e)
		}
		return out
	case string, nil, float64, bool:
		return x
	}
	if n, ok := toInt(v); ok {
		return int64(n)
	}
	return v
}

// TestArrayFormRoundTrip: DecodeKVEventBatch reads the array form back
// into the same events, less locality, which the form cannot carry.
func TestArrayFormRoundTrip(t *testing.T) {
	in := KVEventBatch{TS: 3.25, DataParallelRank: ptr(0), Events: []KVEvent{
		fullStored(),
		{Kind: BlockRemoved, BlockHashes: []uint64{9}, Medium: ptr(MediumStore), GroupIdx: ptr(0), Locality: ptr(LocalityStore)},
		{Kind: AllBlocksCleared},
	}}
	value, err := EncodeKVEventBatch(in, KVEventFormArray)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeKVEventBatch(value)
	if err != nil {
		t.Fatal(err)
	}
	want := in
	want.Events = slices.Clone(in.Events)
	for i := range want.Events {
		want.Events[i].Locality = nil
	}
	if !reflect.DeepEqual(normalizeEvents(got), normalizeEvents(want)) {
		t.Fatalf("read back\n%#v\nwant\n%#v", got, want)
	}
}

// normalizeEvents makes extra_keys comparable across integer widths.
func normalizeEvents(b KVEventBatch) KVEventBatch {
	b.Events = slices.Clone(b.Events)
	for i, e := range b.Events {
		if e.ExtraKeys != nil {
			b.Events[i].ExtraKeys, _ = normalizeInts(e.ExtraKeys).([]any)
		}
	}
	return b
}

// TestMapFormFailsLLMD081 documents why the form is a setting: llm-d-kv-cache
// v0.8.1 reads every event as a list and refuses vLLM's map form, the
// default, which current vLLM writes and newer routers read.
func TestMapFormFailsLLMD081(t *testing.T) {
	value, err := EncodeKVEventBatch(KVEventBatch{TS: 1, DataParallelRank: ptr(0), Events: []KVEvent{fullStored()}}, KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := llmdParse(value); err == nil {
		t.Fatal("llm-d v0.8.1 decoded a map-form event; the array form would not be needed")
	}
	if _, err := DecodeKVEventBatch(value); err != nil {
		t.Fatalf("kvmesh's own decoder refuses the map form: %v", err)
	}
}

// TestKVEventFormNames: map, array and "" (map) are the forms; any other
// name is refused, by the parser, the encoder and a setting's UnmarshalText.
func TestKVEventFormNames(t *testing.T) {
	for in, want := range map[string]KVEventForm{"": KVEventFormMap, "map": KVEventFormMap, "array": KVEventFormArray} {
		if got, err := ParseKVEventForm(in); err != nil || got != want {
			t.Errorf("ParseKVEventForm(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	var f KVEventForm
	if err := f.UnmarshalText([]byte("array")); err != nil || f != KVEventFormArray {
		t.Errorf("UnmarshalText(array) = %q, %v", f, err)
	}
	for _, bad := range []string{"Map", "list", "positional"} {
		if _, err := ParseKVEventForm(bad); !errors.Is(err, ErrKVEventForm) {
			t.Errorf("ParseKVEventForm(%q): %v, want ErrKVEventForm", bad, err)
		}
		if err := f.UnmarshalText([]byte(bad)); !errors.Is(err, ErrKVEventForm) {
			t.Errorf("UnmarshalText(%q): %v, want ErrKVEventForm", bad, err)
		}
	}
	if _, err := EncodeKVEventBatch(KVEventBatch{TS: 1}, "xml"); !errors.Is(err, ErrKVEventForm) {
		t.Errorf("EncodeKVEventBatch in form xml: %v, want ErrKVEventForm", err)
	}
}

// TestRecordAlwaysCarriesRankZero: a record whose batch leaves
// data_parallel_rank nil is written with 0, in either form.
func TestRecordAlwaysCarriesRankZero(t *testing.T) {
	for _, form := range []KVEventForm{KVEventFormMap, KVEventFormArray} {
		rec := KVEventRecord{
			Batch:     KVEventBatch{TS: 1, Events: []KVEvent{{Kind: BlockRemoved, BlockHashes: []uint64{4}, Medium: ptr(MediumStore)}}},
			Namespace: "ns", Hashes: []string{"04"},
		}
		_, value, headers, err := EncodeKVEventRecord(rec, form)
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeKVEventRecord(value, headers)
		if err != nil {
			t.Fatal(err)
		}
		if got.Batch.DataParallelRank == nil || *got.Batch.DataParallelRank != 0 {
			t.Fatalf("%s form: data_parallel_rank %v, want 0", form, got.Batch.DataParallelRank)
		}
	}
}
