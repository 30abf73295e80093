package contract

import (
	"bytes"
	"encoding/binary"
	"errors"
	"maps"
	"reflect"
	"slices"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// routerBatch is the batch shape a KV-aware router decodes vLLM's events
// into: llm-d-router's pkg/kvevents/engineadapter/common.go
// (msgpackEventBatch: a positional array of exactly ts, events and
// data_parallel_rank, decoded by vmihailenco/msgpack into a fixed
// ",array" struct, which fails on any other length).
type routerBatch struct {
	_                struct{} `msgpack:",array"`
	TS               float64
	Events           []msgpack.RawMessage
	DataParallelRank *int `msgpack:",omitempty"`
}

// routerEvent is what llm-d-router's VLLMAdapter makes of one event
// (vllm_adapter.go: decodeVLLMEvent, mapEventToFields, convertBlockStoredEvent,
// convertBlockRemovedEvent): it decodes the event into any, turns a map
// tagged under "type" into the positional layout by field name, and reads
// the positions with bounds checks.
type routerEvent struct {
	tag           string
	hashes        []uint64
	parent        uint64
	tokens        []uint32
	blockSize     int
	loraID        *int
	medium        string
	loraName      *string
	extraKeys     []any
	groupIdx      *int
	specKind      string
	slidingWindow *int
}

// Field orders of llm-d-router's mapEventToFields.
var (
	routerStoredOrder  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
	routerRemovedOrder = []string{"block_hashes", "medium", "group_idx"}
)

// routerDecode decodes value as llm-d-router's VLLMAdapter.ParseMessage does.
func routerDecode(t *testing.T, value []byte) (float64, *int, []routerEvent) {
	t.Helper()
	var b routerBatch
	if err := msgpack.Unmarshal(value, &b); err != nil {
		t.Fatalf("router: decode batch: %v", err)
	}
	var out []routerEvent
	for _, raw := range b.Events {
		var decoded any
		if err := msgpack.Unmarshal(raw, &decoded); err != nil {
			t.Fatalf("router: decode event: %v", err)
		}
		var fields []any
		switch ev := decoded.(type) {
		case []any:
			fields = ev
		case map[string]any:
			tag, _ := ev["type"].(string)
			fields = []any{tag}
			order := map[string][]string{"BlockStored": routerStoredOrder, "BlockRemoved": routerRemovedOrder}[tag]
			for _, name := range order {
				fields = append(fields, ev[name])
			}
		default:
			t.Fatalf("router: event is neither an array nor a map: %T", decoded)
		}
		out = append(out, routerConvert(t, fields))
	}
	return b.TS, b.DataParallelRank, out
}

func fieldAt(fields []any, i int) any {
	if i < len(fields) {
		return fields[i]
	}
	return nil
}

func routerConvert(t *testing.T, f []any) routerEvent {
	t.Helper()
	e := routerEvent{tag: f[0].(string)}
	if e.tag == "AllBlocksCleared" {
		return e
	}
	for _, h := range f[1].([]any) {
		e.hashes = append(e.hashes, routerHash(t, h))
	}
	mediumAt, groupAt := 2, 3
	if e.tag == "BlockStored" {
		mediumAt, groupAt = 6, 9
		if f[2] != nil {
			e.parent = routerHash(t, f[2])
		}
		for _, tok := range f[3].([]any) {
			e.tokens = append(e.tokens, uint32(routerInt(t, tok)))
		}
		e.blockSize = routerInt(t, f[4])
		if v := fieldAt(f, 5); v != nil {
			n := routerInt(t, v)
			e.loraID = &n
		}
		if v := fieldAt(f, 7); v != nil {
			s := v.(string)
			e.loraName = &s
		}
		if v := fieldAt(f, 8); v != nil {
			e.extraKeys = v.([]any)
		}
		if v := fieldAt(f, 10); v != nil {
			e.specKind = v.(string)
		}
		if v := fieldAt(f, 11); v != nil {
			n := routerInt(t, v)
			e.slidingWindow = &n
		}
	}
	if v := fieldAt(f, mediumAt); v != nil {
		e.medium = v.(string)
	}
	if v := fieldAt(f, groupAt); v != nil {
		n := routerInt(t, v)
		e.groupIdx = &n
	}
	return e
}

// routerHash is llm-d-router's getHashAsUint64.
func routerHash(t *testing.T, raw any) uint64 {
	t.Helper()
	switch v := raw.(type) {
	case []byte:
		p := make([]byte, 8)
		copy(p[8-min(len(v), 8):], v[len(v)-min(len(v), 8):])
		return binary.BigEndian.Uint64(p)
	default:
		return uint64(routerInt(t, raw))
	}
}

func routerInt(t *testing.T, raw any) int {
	t.Helper()
	switch v := raw.(type) {
	case int8:
		return int(v)
	case int16:
		return int(v)
	case int32:
		return int(v)
	case int64:
		return int(v)
	case uint8:
		return int(v)
	case uint16:
		return int(v)
	case uint32:
		return int(v)
	case uint64:
		return int(v)
	}
	t.Fatalf("router: unsupported numeric type %T", raw)
	return 0
}

func ptr[T any](v T) *T { return &v }

// TestKVEventsDecodeAsRouter encodes kvmesh's records and decodes them with
// the router-side decoder above, field by field.
func TestKVEventsDecodeAsRouter(t *testing.T) {
	h0 := kvcore.HashTokens(nil, []uint32{1, 2, 3}, nil)
	h1 := kvcore.HashTokens(h0, []uint32{4, 5, 6}, nil)
	big := uint64(1<<63 + 12345) // needs msgpack uint64: above int64
	medium, locality := MediumStore, LocalityStore
	tests := []struct {
		name  string
		event KVEvent
		want  routerEvent
	}{
		{"stored, chain start, mla", KVEvent{
			Kind: BlockStored, BlockHashes: []uint64{WireHash(h0), WireHash(h1)}, TokenIDs: []uint32{},
			BlockSize: 64, Medium: &medium, GroupIdx: ptr(0), SpecKind: SpecKind(kvcore.KindMLA), Locality: &locality,
		}, routerEvent{
			tag: "BlockStored", hashes: []uint64{WireHash(h0), WireHash(h1)}, blockSize: 64,
			medium: MediumStore, groupIdx: ptr(0), specKind: "mla_attention",
		}},
		{"stored with parent, tokens, lora, extra keys, sliding window", KVEvent{
			Kind: BlockStored, BlockHashes: []uint64{big}, ParentBlockHash: ptr(WireHash(h1)), TokenIDs: []uint32{7, 8},
			BlockSize: 2, LoraID: ptr(3), LoraName: ptr("adapter"), Medium: &medium, ExtraKeys: []any{[]any{"adapter", "salt"}},
			GroupIdx: ptr(2), SpecKind: SpecKind(kvcore.KindSlidingWindow), SlidingWindow: ptr(128), Locality: &locality,
		}, routerEvent{
			tag: "BlockStored", hashes: []uint64{big}, parent: WireHash(h1), tokens: []uint32{7, 8}, blockSize: 2,
			loraID: ptr(3), loraName: ptr("adapter"), medium: MediumStore, extraKeys: []any{[]any{"adapter", "salt"}},
			groupIdx: ptr(2), specKind: "sliding_window", slidingWindow: ptr(128),
		}},
		{"removed", KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{1, big}, Medium: &medium, GroupIdx: ptr(1), Locality: &locality},
			routerEvent{tag: "BlockRemoved", hashes: []uint64{1, big}, medium: MediumStore, groupIdx: ptr(1)}},
		{"all cleared", KVEvent{Kind: AllBlocksCleared}, routerEvent{tag: "AllBlocksCleared"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := KVEventBatch{TS: 1700000000.25, Events: []KVEvent{tc.event}, DataParallelRank: ptr(0)}
			value, err := EncodeKVEventBatch(b, KVEventFormMap)
			if err != nil {
				t.Fatal(err)
			}
			ts, rank, got := routerDecode(t, value)
			if ts != b.TS || rank == nil || *rank != 0 || len(got) != 1 {
				t.Fatalf("router read ts %v, rank %v, %d events", ts, rank, len(got))
			}
			if !reflect.DeepEqual(got[0], tc.want) {
				t.Fatalf("router read %+v\nwant %+v", got[0], tc.want)
			}
			back, err := DecodeKVEventBatch(value)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(back, b) {
				t.Fatalf("DecodeKVEventBatch = %+v\nwant %+v", back, b)
			}
		})
	}
}

// TestDecodeKVEventBatchVLLMForms decodes the forms vLLM itself has put on
// the wire: positional array_like events (vLLM before #42892, trailing
// defaults omitted), map events, and bytes hashes
// (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
func TestDecodeKVEventBatchVLLMForms(t *testing.T) {
	hash := []byte{9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8}
	wantHash := binary.BigEndian.Uint64(hash[4:])
	tests := []struct {
		name  string
		batch any
		want  KVEvent
	}{
		{"array event, v0.9 fields", []any{1.0, []any{[]any{"BlockStored", []any{uint64(5)}, nil, []any{1, 2}, 2, nil}}},
			KVEvent{Kind: BlockStored, BlockHashes: []uint64{5}, TokenIDs: []uint32{1, 2}, BlockSize: 2}},
		{"array event with group and trailing field", []any{1.0, []any{[]any{"BlockRemoved", []any{hash}, "GPU", 3, "future"}}, 0},
			KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{wantHash}, Medium: ptr("GPU"), GroupIdx: ptr(3)}},
		{"map event with unknown field", []any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{hash},
			"parent_block_hash": int64(-1), "token_ids": []any{}, "block_size": 16, "lora_id": nil, "medium": "GPU",
			"lora_name": nil, "extra_keys": []any{nil}, "group_idx": 0, "kv_cache_spec_kind": "full_attention", "ownership": "x"}}, 0},
			KVEvent{Kind: BlockStored, BlockHashes: []uint64{wantHash}, ParentBlockHash: ptr(^uint64(0)), TokenIDs: []uint32{},
				BlockSize: 16, Medium: ptr("GPU"), ExtraKeys: []any{nil}, GroupIdx: ptr(0), SpecKind: "full_attention"}},
		// vLLM 2026-08-22: an offloading tier's events (distributed/kv_transfer/
		// kv_connector/v1/offloading/events.py) with medium and locality.
		{"map event of a storage tier", []any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{uint64(5)},
			"parent_block_hash": nil, "token_ids": []any{}, "block_size": 0, "lora_id": nil, "medium": "STORAGE",
			"lora_name": nil, "group_idx": 1, "locality": "REMOTE"}}, 0},
			KVEvent{Kind: BlockStored, BlockHashes: []uint64{5}, TokenIDs: []uint32{}, Medium: ptr("STORAGE"), GroupIdx: ptr(1), Locality: ptr("REMOTE")}},
		{"map removal of a storage tier", []any{1.0, []any{map[string]any{"type": "BlockRemoved", "block_hashes": []any{uint64(5)},
			"medium": "CPU", "group_idx": 1, "locality": "LOCAL"}}, 0},
			KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{5}, Medium: ptr("CPU"), GroupIdx: ptr(1), Locality: ptr("LOCAL")}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			value, err := msgpack.Marshal(tc.batch)
			if err != nil {
				t.Fatal(err)
			}
			b, err := DecodeKVEventBatch(value)
			if err != nil {
				t.Fatal(err)
			}
			if len(b.Events) != 1 || !reflect.DeepEqual(b.Events[0], tc.want) {
				t.Fatalf("decoded %+v\nwant %+v", b.Events, tc.want)
			}
		})
	}
}

func TestDecodeKVEventBatchRejects(t *testing.T) {
	tests := []struct {
		name  string
		batch any
	}{
		{"not a batch", "x"},
		{"short batch", []any{1.0}},
		{"events not a list", []any{1.0, "x"}},
		{"unknown tag", []any{1.0, []any{map[string]any{"type": "BlockMoved"}}}},
		{"hashes not a list", []any{1.0, []any{map[string]any{"type": "BlockRemoved", "block_hashes": 3}}}},
		{"string hash", []any{1.0, []any{[]any{"BlockRemoved", []any{"ab"}}}}},
		{"locality not a string", []any{1.0, []any{map[string]any{"type": "BlockRemoved", "block_hashes": []any{1}, "locality": 1}}}},
		{"extra keys not a list", []any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{1},
			"token_ids": []any{}, "block_size": 16, "extra_keys": "salt"}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			value, err := msgpack.Marshal(tc.batch)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := DecodeKVEventBatch(value); !errors.Is(err, ErrKVEventEncoding) {
				t.Fatalf("error %v, want ErrKVEventEncoding", err)
			}
		})
	}
}

func TestWireHash(t *testing.T) {
	full := kvcore.HashTokens(nil, []uint32{1}, nil)
	tests := []struct {
		name string
		h    kvcore.BlockHash
		want uint64
	}{
		{"sha-256: low 64 bits, big-endian", full, binary.BigEndian.Uint64(full[24:])},
		{"8 bytes", kvcore.BlockHash{0, 0, 0, 0, 0, 0, 1, 2}, 0x0102},
		{"short: zero-padded in front", kvcore.BlockHash{1, 2}, 0x0102},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := WireHash(tc.h); got != tc.want {
				t.Fatalf("WireHash = %#x, want %#x", got, tc.want)
			}
		})
	}
}

func TestKVEventRecordRoundTrip(t *testing.T) {
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m", Fingerprint: "0123456789abcdef"}
	ns := kb.Namespace(kvcore.Rank{TP: 1}, 0)
	h0, h1 := kvcore.HashTokens(nil, []uint32{1}, nil), kvcore.HashTokens(nil, []uint32{2}, nil)
	rec := KVEventRecord{
		Batch: KVEventBatch{TS: 2, DataParallelRank: ptr(0), Events: []KVEvent{
			{Kind: BlockRemoved, BlockHashes: []uint64{WireHash(h0)}, Medium: ptr(MediumStore), GroupIdx: ptr(0)},
			{Kind: BlockRemoved, BlockHashes: []uint64{WireHash(h1)}, Medium: ptr(MediumStore), GroupIdx: ptr(0)},
		}},
		Model: "m", Fingerprint: kb.Fingerprint, Namespace: ns, Hashes: []string{h0.Hex(), h1.Hex()}, Cause: "evicted",
		Ages: []float64{3600.25, -1},
	}
	key, value, headers, err := EncodeKVEventRecord(rec, KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	if key != ns || headers[HeaderKVSchema] != SchemaKVEvent || headers[HeaderKVCause] != "evicted" || headers[HeaderKVFingerprint] != kb.Fingerprint ||
		headers[HeaderKVBlockAges] != "3600.250,-1" {
		t.Fatalf("key %q, headers %v", key, headers)
	}
	if _, ok := headers[HeaderKVRequestID]; ok {
		t.Fatalf("empty request id sent as a header: %v", headers)
	}
	back, err := DecodeKVEventRecord(value, headers)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, rec) || back.Kind() != BlockRemoved {
		t.Fatalf("round trip %+v\nwant %+v", back, rec)
	}
	want := []string{kb.Key(kvcore.Rank{TP: 1}, 0, h0), kb.Key(kvcore.Rank{TP: 1}, 0, h1)}
	if !slices.Equal(back.Keys(), want) {
		t.Fatalf("keys %q, want %q", back.Keys(), want)
	}

	foreign, err := DecodeKVEventRecord(value, nil)
	if err != nil || foreign.Namespace != "" || len(foreign.Batch.Events) != 2 {
		t.Fatalf("record without kvmesh headers: %+v, %v", foreign, err)
	}
	for name, bad := range map[string]KVEventRecord{
		"no namespace":   {Batch: rec.Batch, Hashes: rec.Hashes},
		"hashes missing": {Batch: rec.Batch, Namespace: ns, Hashes: rec.Hashes[:1]},
		"ages missing":   {Batch: rec.Batch, Namespace: ns, Hashes: rec.Hashes, Ages: rec.Ages[:1]},
	} {
		if _, _, _, err := EncodeKVEventRecord(bad, KVEventFormMap); !errors.Is(err, ErrKVEventEncoding) {
			t.Errorf("%s: error %v, want ErrKVEventEncoding", name, err)
		}
	}
	for _, ages := range []string{"1", "1,x", "1,-2", "1,NaN", "1,+Inf"} {
		bad := maps.Clone(headers)
		bad[HeaderKVBlockAges] = ages
		if _, err := DecodeKVEventRecord(value, bad); !errors.Is(err, ErrKVEventEncoding) {
			t.Errorf("ages header %q: error %v, want ErrKVEventEncoding", ages, err)
		}
	}
	headers[HeaderKVBlockHashes] = h0.Hex()
	if _, err := DecodeKVEventRecord(value, headers); !errors.Is(err, ErrKVEventEncoding) {
		t.Errorf("short hash header: error %v", err)
	}
}

// TestKVEventRecordTenant: a tenant's record carries its tenant in a
// header and its keys in the tenant's namespace; the empty tenant sends no
// header.
func TestKVEventRecordTenant(t *testing.T) {
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m", Tenant: "acme"}
	ns := kb.Namespace(kvcore.Rank{}, 0)
	h := kvcore.HashTokens(nil, []uint32{1}, nil)
	rec := KVEventRecord{
		Batch: KVEventBatch{TS: 2, DataParallelRank: ptr(0), Events: []KVEvent{
			{Kind: BlockStored, BlockHashes: []uint64{WireHash(h)}, TokenIDs: []uint32{}, BlockSize: 16, Medium: ptr(MediumStore), GroupIdx: ptr(0), SpecKind: "full_attention"},
		}},
		Model: "m", Namespace: ns, Hashes: []string{h.Hex()}, EngineID: "e1", RequestID: "r1", Tenant: "acme",
	}
	_, value, headers, err := EncodeKVEventRecord(rec, KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	if headers[HeaderKVTenant] != "acme" {
		t.Fatalf("headers %v: want tenant acme", headers)
	}
	back, err := DecodeKVEventRecord(value, headers)
	if err != nil || back.Tenant != "acme" {
		t.Fatalf("round trip tenant %q, %v", back.Tenant, err)
	}
	if keys := back.Keys(); len(keys) != 1 || keys[0] != kb.Key(kvcore.Rank{}, 0, h) {
		t.Fatalf("keys %q, want the tenant's key", keys)
	}
	rec.Tenant = ""
	if _, _, headers, _ = EncodeKVEventRecord(rec, KVEventFormMap); headers[HeaderKVTenant] != "" {
		t.Fatalf("empty tenant sent as a header: %v", headers)
	}
}

// wireEvent reads the first event of an encoded batch as it lies on the
// wire: its field names in the order written, and their values.
func wireEvent(t *testing.T, value []byte) ([]string, map[string]any) {
	t.Helper()
	dec := msgpack.NewDecoder(bytes.NewReader(value))
	if _, err := dec.DecodeArrayLen(); err != nil {
		t.Fatal(err)
	}
	if _, err := dec.DecodeFloat64(); err != nil {
		t.Fatal(err)
	}
	if n, err := dec.DecodeArrayLen(); err != nil || n < 1 {
		t.Fatalf("events: %d, %v", n, err)
	}
	n, err := dec.DecodeMapLen()
	if err != nil {
		t.Fatalf("event is not a map: %v", err)
	}
	var names []string
	values := map[string]any{}
	for range n {
		name, err := dec.DecodeString()
		if err != nil {
			t.Fatal(err)
		}
		if values[name], err = dec.DecodeInterface(); err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
	}
	return names, values
}

// TestKVEventWireFields checks the field names, order and values kvmesh
// writes against vLLM's declarations of 2026-08-22
// (vllm/distributed/kv_events.py: BlockStored block_hashes,
// parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
// then the defaulted extra_keys, group_idx, kv_cache_spec_kind,
// kv_cache_spec_sliding_window, locality; BlockRemoved block_hashes,
// medium, then group_idx, locality): msgspec writes the tag first, the
// fields in declaration order, the ones without a default always (nil
// when unset) and the defaulted ones only when set (omit_defaults).
func TestKVEventWireFields(t *testing.T) {
	medium, locality := MediumStore, LocalityStore
	tests := []struct {
		name   string
		event  KVEvent
		names  []string
		values map[string]any
	}{
		{"kvmesh's BlockStored of a sliding-window group", KVEvent{
			Kind: BlockStored, BlockHashes: []uint64{7}, ParentBlockHash: ptr(uint64(6)), TokenIDs: []uint32{}, BlockSize: 16,
			Medium: &medium, GroupIdx: ptr(1), SpecKind: SpecKind(kvcore.KindSlidingWindow), SlidingWindow: ptr(4096), Locality: &locality,
		}, []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
			"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"},
			map[string]any{"type": "BlockStored", "lora_id": nil, "medium": "CPU", "lora_name": nil, "group_idx": 1,
				"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4096, "locality": "REMOTE"}},
		{"kvmesh's BlockStored of a full-attention group: no window", KVEvent{
			Kind: BlockStored, BlockHashes: []uint64{7}, TokenIDs: []uint32{}, BlockSize: 16,
			Medium: &medium, GroupIdx: ptr(0), SpecKind: SpecKind(kvcore.KindFullAttention), Locality: &locality,
		}, []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
			"group_idx", "kv_cache_spec_kind", "locality"},
			map[string]any{"parent_block_hash": nil, "group_idx": 0, "kv_cache_spec_kind": "full_attention", "locality": "REMOTE"}},
		{"every BlockStored field, as a vLLM engine fills them", KVEvent{
			Kind: BlockStored, BlockHashes: []uint64{7}, TokenIDs: []uint32{1}, BlockSize: 1, LoraID: ptr(2), Medium: ptr("GPU"),
			LoraName: ptr("adapter"), ExtraKeys: []any{[]any{"adapter", "salt"}}, GroupIdx: ptr(0), SpecKind: "mla_attention",
		}, []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
			"extra_keys", "group_idx", "kv_cache_spec_kind"},
			map[string]any{"lora_id": 2, "medium": "GPU", "lora_name": "adapter", "extra_keys": []any{[]any{"adapter", "salt"}}}},
		{"kvmesh's BlockRemoved", KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{7}, Medium: &medium, GroupIdx: ptr(2), Locality: &locality},
			[]string{"type", "block_hashes", "medium", "group_idx", "locality"},
			map[string]any{"type": "BlockRemoved", "medium": "CPU", "group_idx": 2, "locality": "REMOTE"}},
		{"a bare BlockRemoved", KVEvent{Kind: BlockRemoved, BlockHashes: []uint64{7}},
			[]string{"type", "block_hashes", "medium"}, map[string]any{"medium": nil}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			value, err := EncodeKVEventBatch(KVEventBatch{TS: 1, Events: []KVEvent{tc.event}, DataParallelRank: ptr(0)}, KVEventFormMap)
			if err != nil {
				t.Fatal(err)
			}
			names, values := wireEvent(t, value)
			if !slices.Equal(names, tc.names) {
				t.Fatalf("fields on the wire %q\nwant %q", names, tc.names)
			}
			for name, want := range tc.values {
				got := values[name]
				if n, ok := toInt(got); ok {
					got = n // msgpack writes an integer in its smallest form
				}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("%s = %#v, want %#v", name, got, want)
				}
			}
		})
	}
}

// TestPositionalFieldsAreVLLMs pins the array form's field order, read
// from the encoder's field list, to vLLM's declaration order
// (vllm/distributed/kv_events.py, array_like events).
func TestPositionalFieldsAreVLLMs(t *testing.T) {
	for _, tc := range []struct {
		kind KVEventKind
		want []string
	}{
		{BlockStored, []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}},
		{BlockRemoved, []string{"block_hashes", "medium", "group_idx"}},
		{AllBlocksCleared, nil},
	} {
		if got := positional(tc.kind); !slices.Equal(got, tc.want) {
			t.Errorf("%s: positional fields %q, want %q", tc.kind, got, tc.want)
		}
	}
}
