package contract

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// The KV events on TopicKVEvents are vLLM's own: the record value is a
// KVEventBatch encoded as vLLM's ZmqEventPublisher encodes it
// (vllm/distributed/kv_events.py, _publisher_thread: msgspec msgpack), so a
// router that indexes vLLM's events (llm-d's kvevents VLLMAdapter, Dynamo's
// KV router) decodes it with its own decoder. kvmesh's own fields travel in
// record headers, which those decoders never read. docs/contract.md has the
// schema.

// MediumStore is the medium (vLLM's tier name; llm-d's device tier) of the
// blocks kvmesh announces. vLLM names three media
// (vllm/distributed/kv_events.py: MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE;
// vllm/v1/kv_offload/base.py, Medium): GPU memory, CPU memory (DRAM) and
// STORAGE (file-system and object-store tiers). kvmesh's store is Redis,
// DRAM, so it is CPU, as vLLM's own Mooncake store connector announces the
// blocks it puts in a distributed memory pool; LocalityStore tells it from
// an engine's own CPU tier.
const MediumStore = "CPU"

// MediumTier is the medium of the blocks the capacity tier holds (an
// S3-compatible bucket below Redis, pkg/kvtier): vLLM's MEDIUM_STORAGE
// (vllm/distributed/kv_events.py; vllm/v1/kv_offload/base.py,
// Medium.STORAGE), the medium of file-system and object-store tiers, as
// vLLM's offloading connector announces the blocks it stores there. Their
// locality is LocalityStore: the bucket is shared by every engine.
const MediumTier = "STORAGE"

// LocalityStore is the locality (vLLM's BlockStored/BlockRemoved.locality,
// vllm/v1/kv_offload/base.py, Locality: LOCAL or REMOTE relative to the
// publisher) of the blocks kvmesh announces: the store pool is shared by
// every engine and reached over the network, remote to all of them.
const LocalityStore = "REMOTE"

// Headers of a TopicKVEvents record: kvmesh's fields beside the vLLM batch.
const (
	// HeaderKVSchema is SchemaKVEvent.
	HeaderKVSchema = "kvmesh-schema"
	// HeaderKVModel is the model name of the keys.
	HeaderKVModel = "kvmesh-model"
	// HeaderKVFingerprint is the model's compatibility fingerprint
	// (kvcore.Model.Fingerprint), the "fp:" segment of the keys.
	HeaderKVFingerprint = "kvmesh-fingerprint"
	// HeaderKVNamespace is the store namespace of every block of the record.
	HeaderKVNamespace = "kvmesh-namespace"
	// HeaderKVBlockHashes lists the full block hashes in hex, comma
	// separated, one per wire hash of the batch's events, in order.
	HeaderKVBlockHashes = "kvmesh-block-hashes"
	// HeaderKVEngineID is the engine whose save stored the blocks.
	HeaderKVEngineID = "kvmesh-engine-id"
	// HeaderKVRequestID is the request whose save stored the blocks.
	HeaderKVRequestID = "kvmesh-request-id"
	// HeaderKVCause says why blocks went: evicted, expired, del, quota (a
	// del a tenant quota made) or flushed.
	HeaderKVCause = "kvmesh-cause"
	// HeaderKVBlockAges lists, for a removal, each block's age when it was
	// removed: seconds since it was stored (three decimals), comma
	// separated, one per hash of HeaderKVBlockHashes, -1 where the store
	// kept no store time for it (kvstore.StoreTimes).
	HeaderKVBlockAges = "kvmesh-block-ages"
	// HeaderKVTenant is the tenant whose keys the record is about
	// (kvcore.KeyBuilder.Tenant); absent for the empty tenant.
	HeaderKVTenant = "kvmesh-tenant"
)

// vLLM's kv_cache_spec_kind values (vllm/v1/kv_cache_interface.py,
// KVCacheSpecKind) for kvmesh's group kinds.
const (
	specFullAttention = "full_attention"
	specMLA           = "mla_attention"
	specSlidingWindow = "sliding_window"
	specMamba         = "mamba"
)

// Sentinel errors of the KV-event codec.
var (
	// ErrKVEventEncoding reports a record value or header set that is not a
	// KV-event record kvmesh can read.
	ErrKVEventEncoding = errors.New("contract: malformed kv event")
	// ErrKVEventForm reports a KV-event wire form other than map or array.
	ErrKVEventForm = errors.New("contract: unknown kv event form")
)

// WireHash is a block hash as vLLM puts it on the wire by default: the
// hash's bytes read as a big-endian integer, cut to its low 64 bits
// (vllm/v1/core/kv_cache_utils.py, maybe_convert_block_hash with
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). llm-d reads a bytes hash the same
// way (getHashAsUint64: its last 8 bytes, big-endian), so both forms index
// alike. A hash shorter than 8 bytes is zero-padded in front.
func WireHash(h kvcore.BlockHash) uint64 {
	var b [8]byte
	n := min(len(h), 8)
	copy(b[8-n:], h[len(h)-n:])
	return binary.BigEndian.Uint64(b[:])
}

// SpecKind is vLLM's kv_cache_spec_kind for a kvmesh group kind.
func SpecKind(k kvcore.Kind) string {
	switch k {
	case kvcore.KindMLA:
		return specMLA
	case kvcore.KindSlidingWindow:
		return specSlidingWindow
	case kvcore.KindMamba:
		return specMamba
	}
	return specFullAttention
}

// UnixSeconds is t as KVEventBatch.TS: seconds since the Unix epoch.
func UnixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

// KVEventForm is the wire form of the events of an encoded KVEventBatch.
// The batch is vLLM's positional array in both; the events differ:
//
//   - KVEventFormMap ("map", the default; the zero value reads as it):
//     each event a map tagged under "type", as vLLM writes its events
//     after vllm-project/vllm#42892 (the form that carries locality).
//   - KVEventFormArray ("array"): each event a positional array
//     [tag, fields...], as vLLM's array_like event structs wrote them
//     before, the only form llm-d-kv-cache up to v0.8.1 decodes
//     (engineadapter.VLLMAdapter reads the event into a list).
type KVEventForm string

// The wire forms of KV events.
const (
	KVEventFormMap   KVEventForm = "map"
	KVEventFormArray KVEventForm = "array"
)

// ParseKVEventForm reads a form name: "map" or "array" ("" is map).
func ParseKVEventForm(s string) (KVEventForm, error) {
	f := KVEventForm(s)
	if err := f.Validate(); err != nil {
		return "", err
	}
	if f == "" {
		return KVEventFormMap, nil
	}
	return f, nil
}

// Validate reports a form other than map, array or "" (map).
func (f KVEventForm) Validate() error {
	switch f {
	case "", KVEventFormMap, KVEventFormArray:
		return nil
	}
	return fmt.Errorf("kv event form %q (want map or array): %w", string(f), ErrKVEventForm)
}

// UnmarshalText parses a form name (ParseKVEventForm), so a setting of
// this type refuses any other value when the configuration is read.
func (f *KVEventForm) UnmarshalText(b []byte) error {
	v, err := ParseKVEventForm(string(b))
	if err != nil {
		return err
	}
	*f = v
	return nil
}

// EncodeKVEventBatch encodes b in form as vLLM's ZmqEventPublisher does:
// the batch is a positional array [ts, events, data_parallel_rank]
// (data_parallel_rank left out when nil, as msgspec's omit_defaults does).
// In the map form (vLLM after vllm-project/vllm#42892) each event is a map
// tagged under "type" with vLLM's field names in declaration order: the
// fields with a default (extra_keys, group_idx, kv_cache_spec_kind,
// kv_cache_spec_sliding_window, locality) are left out when unset, the
// fields without one (lora_id, medium, lora_name) are always written, nil
// when unset. In the array form (vLLM's array_like structs before it) each
// event is [tag, fields in declaration order...] with omit_defaults' rule
// for arrays: only a trailing run of unset fields with a default is left
// off, an unset one before a set one is written as nil; locality has no
// position there and is dropped.
func EncodeKVEventBatch(b KVEventBatch, form KVEventForm) ([]byte, error) {
	if err := form.Validate(); err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	w := writer{enc: enc, form: form}
	n := 2
	if b.DataParallelRank != nil {
		n = 3
	}
	w.arrayLen(n)
	w.err = errors.Join(w.err, enc.EncodeFloat64(b.TS))
	w.arrayLen(len(b.Events))
	for _, e := range b.Events {
		w.event(e)
	}
	if b.DataParallelRank != nil {
		w.int(*b.DataParallelRank)
	}
	if w.err != nil {
		return nil, fmt.Errorf("encode kv event batch: %w", w.err)
	}
	return buf.Bytes(), nil
}

// writer writes msgpack values in one event form, keeping the first error.
type writer struct {
	enc  *msgpack.Encoder
	form KVEventForm
	err  error
}

func (w *writer) arrayLen(n int) { w.keep(w.enc.EncodeArrayLen(n)) }
func (w *writer) str(s string)   { w.keep(w.enc.EncodeString(s)) }
func (w *writer) int(v int)      { w.keep(w.enc.EncodeInt(int64(v))) }
func (w *writer) nil()           { w.keep(w.enc.EncodeNil()) }

func (w *writer) keep(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *writer) optInt(v *int) {
	if v == nil {
		w.nil()
		return
	}
	w.int(*v)
}

func (w *writer) optStr(v *string) {
	if v == nil {
		w.nil()
		return
	}
	w.str(*v)
}

// hash writes a block hash as a msgpack uint 64, whatever its value:
// llm-d-kv-cache (getHashAsUint64) reads a hash only as a 64-bit integer
// or bytes and refuses the narrower integers a compact encoding would pick
// for a small value.
func (w *writer) hash(h uint64) { w.keep(w.enc.EncodeUint64(h)) }

func (w *writer) optHash(v *uint64) {
	if v == nil {
		w.nil()
		return
	}
	w.hash(*v)
}

func (w *writer) hashes(hs []uint64) {
	w.arrayLen(len(hs))
	for _, h := range hs {
		w.hash(h)
	}
}

func (w *writer) tokens(ts []uint32) {
	w.arrayLen(len(ts))
	for _, t := range ts {
		w.keep(w.enc.EncodeUint(uint64(t)))
	}
}

// field is one event field: its vLLM name, whether it is written (false
// only for an unset field that has a default), whether it has a position
// in the array form, and its writer.
type field struct {
	name  string
	set   bool
	array bool
	write func()
}

// always is a field without a default: written in both forms.
func always(name string, write func()) field {
	return field{name: name, set: true, array: true, write: write}
}

// fields are e's fields in vLLM's declaration order.
func (w *writer) fields(e KVEvent) ([]field, error) {
	switch e.Kind {
	case BlockStored:
		return []field{
			always("block_hashes", func() { w.hashes(e.BlockHashes) }),
			always("parent_block_hash", func() { w.optHash(e.ParentBlockHash) }),
			always("token_ids", func() { w.tokens(e.TokenIDs) }),
			always("block_size", func() { w.int(e.BlockSize) }),
			always("lora_id", func() { w.optInt(e.LoraID) }),
			always("medium", func() { w.optStr(e.Medium) }),
			always("lora_name", func() { w.optStr(e.LoraName) }),
			{"extra_keys", e.ExtraKeys != nil, true, func() { w.keep(w.enc.Encode(e.ExtraKeys)) }},
			{"group_idx", e.GroupIdx != nil, true, func() { w.optInt(e.GroupIdx) }},
			{"kv_cache_spec_kind", e.SpecKind != "", true, func() { w.optStr(nonEmpty(e.SpecKind)) }},
			{"kv_cache_spec_sliding_window", e.SlidingWindow != nil, true, func() { w.optInt(e.SlidingWindow) }},
			{"locality", e.Locality != nil, false, func() { w.optStr(e.Locality) }},
		}, nil
	case BlockRemoved:
		return []field{
			always("block_hashes", func() { w.hashes(e.BlockHashes) }),
			always("medium", func() { w.optStr(e.Medium) }),
			{"group_idx", e.GroupIdx != nil, true, func() { w.optInt(e.GroupIdx) }},
			{"locality", e.Locality != nil, false, func() { w.optStr(e.Locality) }},
		}, nil
	case AllBlocksCleared:
		return nil, nil
	}
	return nil, fmt.Errorf("event kind %q: %w", e.Kind, ErrKVEventEncoding)
}

func nonEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// event writes one event in the writer's form.
func (w *writer) event(e KVEvent) {
	fields, err := w.fields(e)
	if err != nil {
		w.keep(err)
		return
	}
	if w.form == KVEventFormArray {
		w.arrayEvent(string(e.Kind), fields)
		return
	}
	w.mapEvent(string(e.Kind), fields)
}

// mapEvent writes the set fields as a map, the tag first (msgspec puts
// the tag first, then the fields in declaration order).
func (w *writer) mapEvent(tag string, fields []field) {
	fields = slices.DeleteFunc(fields, func(f field) bool { return !f.set })
	w.keep(w.enc.EncodeMapLen(len(fields) + 1))
	w.str("type")
	w.str(tag)
	for _, f := range fields {
		w.str(f.name)
		f.write()
	}
}

// arrayEvent writes [tag, fields...]: the fields with a position, less
// the trailing run of unset ones (an unset field writes its default, nil).
func (w *writer) arrayEvent(tag string, fields []field) {
	fields = slices.DeleteFunc(fields, func(f field) bool { return !f.array })
	for len(fields) > 0 && !fields[len(fields)-1].set {
		fields = fields[:len(fields)-1]
	}
	w.arrayLen(len(fields) + 1)
	w.str(tag)
	for _, f := range fields {
		f.write()
	}
}

// DecodeKVEventBatch decodes a vLLM KVEventBatch: the batch as an array
// [ts, events, data_parallel_rank?, ...] (or, for safety, a map with those
// names), each event either a map tagged under "type" (vLLM after
// vllm-project/vllm#42892) or a positional array [tag, fields...] (vLLM's
// array_like structs before it), as llm-d's VLLMAdapter accepts. Unknown
// fields and trailing array elements are skipped; hashes may be integers
// or bytes (bytes read as WireHash does).
func DecodeKVEventBatch(value []byte) (KVEventBatch, error) {
	dec := msgpack.NewDecoder(bytes.NewReader(value))
	v, err := dec.DecodeInterface()
	if err != nil {
		return KVEventBatch{}, fmt.Errorf("decode kv event batch: %v: %w", err, ErrKVEventEncoding)
	}
	var ts, events, rank any
	switch b := v.(type) {
	case []any:
		if len(b) < 2 {
			return KVEventBatch{}, fmt.Errorf("kv event batch of %d fields: %w", len(b), ErrKVEventEncoding)
		}
		ts, events = b[0], b[1]
		if len(b) > 2 {
			rank = b[2]
		}
	case map[string]any:
		ts, events, rank = b["ts"], b["events"], b["data_parallel_rank"]
	default:
		return KVEventBatch{}, fmt.Errorf("kv event batch is a %T: %w", v, ErrKVEventEncoding)
	}
	var out KVEventBatch
	var ok bool
	if out.TS, ok = toFloat(ts); !ok {
		return KVEventBatch{}, fmt.Errorf("kv event batch ts %v: %w", ts, ErrKVEventEncoding)
	}
	if rank != nil {
		r, ok := toInt(rank)
		if !ok {
			return KVEventBatch{}, fmt.Errorf("kv event batch data_parallel_rank %v: %w", rank, ErrKVEventEncoding)
		}
		out.DataParallelRank = &r
	}
	list, ok := events.([]any)
	if !ok {
		return KVEventBatch{}, fmt.Errorf("kv event batch events are a %T: %w", events, ErrKVEventEncoding)
	}
	for i, raw := range list {
		e, err := decodeEvent(raw)
		if err != nil {
			return KVEventBatch{}, fmt.Errorf("kv event %d: %w", i, err)
		}
		out.Events = append(out.Events, e)
	}
	return out, nil
}

// Positional field names of vLLM's array_like events after the tag, in
// declaration order (vllm/distributed/kv_events.py): the encoder's fields
// (writer.fields) that the array form carries, so the two forms share one
// list. locality is not among them: vLLM added it after it had dropped
// array_like from the events (the 2026-08-22 tree), so it only ever
// travels in the map form, and a trailing element past these stays an
// unknown field, skipped.
var (
	storedFields  = positional(BlockStored)
	removedFields = positional(BlockRemoved)
)

// positional names kind's fields of the array form, in order.
func positional(kind KVEventKind) []string {
	fields, _ := (&writer{}).fields(KVEvent{Kind: kind}) // only the names are read
	var names []string
	for _, f := range fields {
		if f.array {
			names = append(names, f.name)
		}
	}
	return names
}

// decodeEvent decodes one event, map or positional array, into a KVEvent.
func decodeEvent(raw any) (KVEvent, error) {
	fields := map[string]any{}
	var tag any
	switch ev := raw.(type) {
	case map[string]any:
		tag, fields = ev["type"], ev
	case []any:
		if len(ev) == 0 {
			return KVEvent{}, fmt.Errorf("event without a tag: %w", ErrKVEventEncoding)
		}
		tag = ev[0]
		names := storedFields
		if tag == string(BlockRemoved) {
			names = removedFields
		}
		for i, v := range ev[1:] {
			if i < len(names) {
				fields[names[i]] = v
			}
		}
	default:
		return KVEvent{}, fmt.Errorf("event is a %T: %w", raw, ErrKVEventEncoding)
	}
	kind, _ := tag.(string)
	e := KVEvent{Kind: KVEventKind(kind)}
	switch e.Kind {
	case BlockStored, BlockRemoved:
	case AllBlocksCleared:
		return e, nil
	default:
		return KVEvent{}, fmt.Errorf("event tag %v: %w", tag, ErrKVEventEncoding)
	}
	var err error
	if e.BlockHashes, err = decodeHashes(fields["block_hashes"]); err != nil {
		return KVEvent{}, err
	}
	r := reader{fields: fields}
	e.Medium = r.optStr("medium")
	e.GroupIdx = r.optInt("group_idx")
	e.Locality = r.optStr("locality")
	if e.Kind == BlockStored {
		if p := fields["parent_block_hash"]; p != nil {
			h, ok := toHash(p)
			if !ok {
				return KVEvent{}, fmt.Errorf("parent_block_hash %v: %w", p, ErrKVEventEncoding)
			}
			e.ParentBlockHash = &h
		}
		e.TokenIDs = r.tokens("token_ids")
		if bs := r.optInt("block_size"); bs != nil {
			e.BlockSize = *bs
		}
		e.LoraID = r.optInt("lora_id")
		e.LoraName = r.optStr("lora_name")
		e.ExtraKeys = r.list("extra_keys")
		if k := r.optStr("kv_cache_spec_kind"); k != nil {
			e.SpecKind = *k
		}
		e.SlidingWindow = r.optInt("kv_cache_spec_sliding_window")
	}
	return e, r.err
}

// reader reads typed fields of a decoded event, keeping the first error.
type reader struct {
	fields map[string]any
	err    error
}

func (r *reader) fail(name string, v any) {
	if r.err == nil {
		r.err = fmt.Errorf("field %s = %v (%T): %w", name, v, v, ErrKVEventEncoding)
	}
}

func (r *reader) optInt(name string) *int {
	v := r.fields[name]
	if v == nil {
		return nil
	}
	n, ok := toInt(v)
	if !ok {
		r.fail(name, v)
		return nil
	}
	return &n
}

func (r *reader) optStr(name string) *string {
	v := r.fields[name]
	if v == nil {
		return nil
	}
	s, ok := v.(string)
	if !ok {
		r.fail(name, v)
		return nil
	}
	return &s
}

// list reads a list field as the msgpack values it holds (nil when absent).
func (r *reader) list(name string) []any {
	v := r.fields[name]
	if v == nil {
		return nil
	}
	l, ok := v.([]any)
	if !ok {
		r.fail(name, v)
		return nil
	}
	return l
}

func (r *reader) tokens(name string) []uint32 {
	list, ok := r.fields[name].([]any)
	if !ok {
		if r.fields[name] != nil {
			r.fail(name, r.fields[name])
		}
		return nil
	}
	out := make([]uint32, 0, len(list))
	for _, v := range list {
		n, ok := toInt(v)
		if !ok || n < 0 || n > math.MaxUint32 {
			r.fail(name, v)
			return nil
		}
		out = append(out, uint32(n))
	}
	return out
}

func decodeHashes(v any) ([]uint64, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("block_hashes = %v (%T): %w", v, v, ErrKVEventEncoding)
	}
	out := make([]uint64, 0, len(list))
	for _, h := range list {
		u, ok := toHash(h)
		if !ok {
			return nil, fmt.Errorf("block hash %v (%T): %w", h, h, ErrKVEventEncoding)
		}
		out = append(out, u)
	}
	return out, nil
}

// toHash reads an integer hash, or a bytes hash as WireHash does.
func toHash(v any) (uint64, bool) {
	if b, ok := v.([]byte); ok {
		if len(b) == 0 {
			return 0, false
		}
		return WireHash(b), true
	}
	switch n := v.(type) {
	case uint64:
		return n, true
	case int64:
		return uint64(n), true // a negative hash is the signed form of the same 64 bits
	}
	i, ok := toInt(v)
	return uint64(i), ok && i >= 0
}

func toInt(v any) (int, bool) {
	switch n := v.(type) {
	case int8:
		return int(n), true
	case int16:
		return int(n), true
	case int32:
		return int(n), true
	case int64:
		return int(n), true
	case uint8:
		return int(n), true
	case uint16:
		return int(n), true
	case uint32:
		return int(n), true
	case uint64:
		if n > math.MaxInt64 {
			return 0, false
		}
		return int(n), true
	}
	return 0, false
}

func toFloat(v any) (float64, bool) {
	switch n := v.(type) {
	case float64:
		return n, true
	case float32:
		return float64(n), true
	}
	i, ok := toInt(v)
	return float64(i), ok
}

// EncodeKVEventRecord returns the record key, value and headers of r on
// TopicKVEvents: the key is r.Namespace, the value the vLLM batch in form
// (EncodeKVEventBatch), the headers kvmesh's fields (empty ones left out).
// The batch's data_parallel_rank is written as 0 when r leaves it nil:
// every record kvmesh produces carries it, as a vLLM engine without data
// parallelism does.
func EncodeKVEventRecord(r KVEventRecord, form KVEventForm) (key string, value []byte, headers map[string]string, err error) {
	if r.Namespace == "" {
		return "", nil, nil, fmt.Errorf("kv event record without a namespace: %w", ErrKVEventEncoding)
	}
	n := 0
	for _, e := range r.Batch.Events {
		n += len(e.BlockHashes)
	}
	if n != len(r.Hashes) {
		return "", nil, nil, fmt.Errorf("kv event record of %d wire hashes names %d hashes: %w", n, len(r.Hashes), ErrKVEventEncoding)
	}
	if r.Batch.DataParallelRank == nil {
		r.Batch.DataParallelRank = new(int)
	}
	if value, err = EncodeKVEventBatch(r.Batch, form); err != nil {
		return "", nil, nil, err
	}
	headers = map[string]string{HeaderKVSchema: SchemaKVEvent, HeaderKVModel: r.Model, HeaderKVNamespace: r.Namespace}
	if len(r.Ages) > 0 && len(r.Ages) != len(r.Hashes) {
		return "", nil, nil, fmt.Errorf("kv event record of %d hashes has %d ages: %w", len(r.Hashes), len(r.Ages), ErrKVEventEncoding)
	}
	for name, v := range map[string]string{
		HeaderKVBlockHashes: strings.Join(r.Hashes, ","), HeaderKVBlockAges: formatAges(r.Ages), HeaderKVEngineID: r.EngineID,
		HeaderKVRequestID: r.RequestID, HeaderKVCause: r.Cause, HeaderKVTenant: r.Tenant, HeaderKVFingerprint: r.Fingerprint,
	} {
		if v != "" {
			headers[name] = v
		}
	}
	return r.Namespace, value, headers, nil
}

// DecodeKVEventRecord reads a TopicKVEvents record back: its value as a
// vLLM batch and kvmesh's fields from its headers. A record without
// kvmesh's schema header (say, an engine's own vLLM events bridged onto
// the topic) keeps its batch and leaves kvmesh's fields empty.
func DecodeKVEventRecord(value []byte, headers map[string]string) (KVEventRecord, error) {
	b, err := DecodeKVEventBatch(value)
	if err != nil {
		return KVEventRecord{}, err
	}
	r := KVEventRecord{Batch: b}
	if headers[HeaderKVSchema] != SchemaKVEvent {
		return r, nil
	}
	r.Model, r.Namespace = headers[HeaderKVModel], headers[HeaderKVNamespace]
	r.EngineID, r.RequestID, r.Cause = headers[HeaderKVEngineID], headers[HeaderKVRequestID], headers[HeaderKVCause]
	r.Tenant, r.Fingerprint = headers[HeaderKVTenant], headers[HeaderKVFingerprint]
	if h := headers[HeaderKVBlockHashes]; h != "" {
		r.Hashes = strings.Split(h, ",")
	}
	if a := headers[HeaderKVBlockAges]; a != "" {
		if r.Ages, err = parseAges(a, len(r.Hashes)); err != nil {
			return KVEventRecord{}, err
		}
	}
	n := 0
	for _, e := range b.Events {
		n += len(e.BlockHashes)
	}
	if n != len(r.Hashes) {
		return KVEventRecord{}, fmt.Errorf("kv event record of %d wire hashes names %d hashes: %w", n, len(r.Hashes), ErrKVEventEncoding)
	}
	return r, nil
}

// Keys are the store keys of the record's blocks, in event order.
func (r KVEventRecord) Keys() []string {
	out := make([]string, len(r.Hashes))
	for i, h := range r.Hashes {
		out[i] = r.Namespace + "@" + h
	}
	return out
}

// Kind is the kind of the record's first event ("" for an empty batch):
// kvmesh's records carry events of one kind each.
func (r KVEventRecord) Kind() KVEventKind {
	if len(r.Batch.Events) == 0 {
		return ""
	}
	return r.Batch.Events[0].Kind
}

// formatAges writes ages as HeaderKVBlockAges does: seconds with three
// decimals, -1 for an unknown age; "" for none.
func formatAges(ages []float64) string {
	if len(ages) == 0 {
		return ""
	}
	b := make([]byte, 0, 8*len(ages))
	for i, a := range ages {
		if i > 0 {
			b = append(b, ',')
		}
		if a < 0 {
			b = append(b, "-1"...)
			continue
		}
		b = strconv.AppendFloat(b, a, 'f', 3, 64)
	}
	return string(b)
}

// parseAges reads HeaderKVBlockAges: n ages, each -1 or a non-negative
// number of seconds.
func parseAges(h string, n int) ([]float64, error) {
	parts := strings.Split(h, ",")
	if len(parts) != n {
		return nil, fmt.Errorf("kv event record of %d hashes names %d ages: %w", n, len(parts), ErrKVEventEncoding)
	}
	ages := make([]float64, n)
	for i, p := range parts {
		a, err := strconv.ParseFloat(p, 64)
		if err != nil || math.IsNaN(a) || math.IsInf(a, 0) || (a < 0 && a != -1) {
			return nil, fmt.Errorf("kv event record age %q: want seconds or -1: %w", p, ErrKVEventEncoding)
		}
		ages[i] = a
	}
	return ages, nil
}
