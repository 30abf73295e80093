package tierevents

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// fakePublisher records what is published; fail, when set, answers each
// call first (nil: recorded).
type fakePublisher struct {
	mu    sync.Mutex
	msgs  []bus.Message
	calls int
	fail  func(call int) error
}

func (p *fakePublisher) Publish(_ context.Context, msgs ...bus.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.fail != nil {
		if err := p.fail(p.calls); err != nil {
			return err
		}
	}
	p.msgs = append(p.msgs, msgs...)
	return nil
}

// reset forgets what was published.
func (p *fakePublisher) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = nil
}

func (p *fakePublisher) messages() []bus.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.msgs)
}

// records decodes every published message, checking its topic and key.
func (p *fakePublisher) records(t *testing.T) []contract.KVEventRecord {
	t.Helper()
	var out []contract.KVEventRecord
	for _, m := range p.messages() {
		if m.Topic != contract.TopicKVEvents {
			t.Fatalf("published on %q, want %q", m.Topic, contract.TopicKVEvents)
		}
		r, err := contract.DecodeKVEventRecord(m.Value, m.Headers)
		if err != nil {
			t.Fatalf("DecodeKVEventRecord: %v", err)
		}
		if m.Key != r.Namespace {
			t.Fatalf("record key %q, want its namespace %q", m.Key, r.Namespace)
		}
		out = append(out, r)
	}
	return out
}

// blocks counts the hashes of the published records.
func (p *fakePublisher) blocks(t *testing.T) int {
	t.Helper()
	n := 0
	for _, r := range p.records(t) {
		n += len(r.Hashes)
	}
	return n
}

var fp = strings.Repeat("0a", kvcore.FingerprintLen/2)

// hashOf is a distinct 32-byte block hash for i.
func hashOf(i int) kvcore.BlockHash {
	h := make(kvcore.BlockHash, 32)
	for j := range h {
		h[j] = byte(i>>(8*(j%4))) ^ byte(j)
	}
	return h
}

func newAnnouncer(t *testing.T, pub Publisher, o Options) *Announcer {
	t.Helper()
	o.Publisher = pub
	if o.Registry == nil {
		o.Registry = prometheus.NewRegistry()
	}
	if o.Backoff.Initial == 0 {
		o.Backoff = retry.Backoff{Initial: time.Millisecond, Max: time.Millisecond}
	}
	a, err := New(o)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return a
}

// start runs a until the test ends; stop cancels it and waits for Run,
// which must return nil.
func start(t *testing.T, a *Announcer) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run = %v, want nil", err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("Run did not return after its context ended")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// eventually polls cond until it holds or 5 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func dropped(a *Announcer, reason string) int {
	return int(testutil.ToFloat64(a.dropped.WithLabelValues(reason)))
}

func TestPlaceholderStoredEvents(t *testing.T) {
	t.Parallel()
	short := kvcore.BlockHash{0xde, 0xad, 0xbe, 0xef}
	cases := []struct {
		name  string
		kb    kvcore.KeyBuilder
		rank  kvcore.Rank
		group int
		hs    []kvcore.BlockHash
	}{
		{"model and fingerprint, group 0", kvcore.KeyBuilder{Model: "llama", Fingerprint: fp}, kvcore.Rank{}, 0, []kvcore.BlockHash{hashOf(1)}},
		{"prefix, tenant, rank, group 3", kvcore.KeyBuilder{Prefix: "prod", Model: "qwen", Fingerprint: fp, Tenant: "acme"}, kvcore.Rank{TP: 1, PP: 1}, 3, []kvcore.BlockHash{hashOf(2), hashOf(3), hashOf(4)}},
		{"no fingerprint, short hash", kvcore.KeyBuilder{Model: "m"}, kvcore.Rank{}, 1, []kvcore.BlockHash{short}},
	}
	for _, form := range []contract.KVEventForm{contract.KVEventFormMap, contract.KVEventFormArray} {
		for _, tc := range cases {
			t.Run(string(form)+"/"+tc.name, func(t *testing.T) {
				t.Parallel()
				pub := &fakePublisher{}
				now := time.Unix(1700000000, 500_000_000)
				a := newAnnouncer(t, pub, Options{Form: form, Now: func() time.Time { return now }})
				for _, h := range tc.hs {
					a.Stored(tc.kb.Key(tc.rank, tc.group, h))
				}
				a.drain()
				a.flush(t.Context(), true)

				recs := pub.records(t)
				if len(recs) != 1 {
					t.Fatalf("%d records, want 1", len(recs))
				}
				r := recs[0]
				ns := tc.kb.Namespace(tc.rank, tc.group)
				var hexes []string
				for _, h := range tc.hs {
					hexes = append(hexes, h.Hex())
				}
				if r.Namespace != ns || r.Model != tc.kb.Model || r.Fingerprint != tc.kb.Fingerprint || r.Tenant != tc.kb.Tenant ||
					!slices.Equal(r.Hashes, hexes) || r.Cause != "" || r.EngineID != "" || r.RequestID != "" || r.Ages != nil {
					t.Errorf("record %+v, want namespace %q model %q fingerprint %q tenant %q hashes %v and no cause, engine, request or ages",
						r, ns, tc.kb.Model, tc.kb.Fingerprint, tc.kb.Tenant, hexes)
				}
				if r.Batch.TS != contract.UnixSeconds(now) || r.Batch.DataParallelRank == nil || *r.Batch.DataParallelRank != 0 {
					t.Errorf("batch ts %v rank %v, want %v and 0", r.Batch.TS, r.Batch.DataParallelRank, contract.UnixSeconds(now))
				}
				if len(r.Batch.Events) != len(tc.hs) {
					t.Fatalf("%d events, want one per block (%d)", len(r.Batch.Events), len(tc.hs))
				}
				for i, e := range r.Batch.Events {
					checkPlaceholder(t, e, contract.WireHash(tc.hs[i]), tc.group, form)
				}
				if form == contract.KVEventFormMap {
					checkRawMap(t, pub.messages()[0].Value)
				}
			})
		}
	}
}

// checkPlaceholder checks a decoded event against vLLM's _placeholder_stored.
func checkPlaceholder(t *testing.T, e contract.KVEvent, wire uint64, group int, form contract.KVEventForm) {
	t.Helper()
	if e.Kind != contract.BlockStored || !slices.Equal(e.BlockHashes, []uint64{wire}) {
		t.Errorf("event %s %v, want BlockStored [%d]", e.Kind, e.BlockHashes, wire)
	}
	if e.ParentBlockHash != nil || len(e.TokenIDs) != 0 || e.BlockSize != 0 || e.LoraID != nil || e.LoraName != nil ||
		e.ExtraKeys != nil || e.SpecKind != "" || e.SlidingWindow != nil {
		t.Errorf("event %+v: want no parent, tokens, block size, LoRA, extra keys or spec", e)
	}
	if e.Medium == nil || *e.Medium != "STORAGE" || contract.MediumTier != "STORAGE" {
		t.Errorf("medium %v, want STORAGE", e.Medium)
	}
	if e.GroupIdx == nil || *e.GroupIdx != group {
		t.Errorf("group_idx %v, want %d", e.GroupIdx, group)
	}
	switch form {
	case contract.KVEventFormArray: // no position for locality in the array form
		if e.Locality != nil {
			t.Errorf("array form locality %q, want none", *e.Locality)
		}
	default:
		if e.Locality == nil || *e.Locality != "REMOTE" {
			t.Errorf("locality %v, want REMOTE", e.Locality)
		}
	}
}

// checkRawMap checks the map-form value as msgspec writes vLLM's
// placeholder: exactly these fields, token_ids an empty array, the unset
// fields without a default written as nil.
func checkRawMap(t *testing.T, value []byte) {
	t.Helper()
	var batch []any
	if err := msgpack.Unmarshal(value, &batch); err != nil {
		t.Fatalf("unmarshal batch: %v", err)
	}
	events, _ := batch[1].([]any)
	ev, ok := events[0].(map[string]any)
	if !ok {
		t.Fatalf("event %T, want a map", events[0])
	}
	var names []string
	for k := range ev {
		names = append(names, k)
	}
	slices.Sort(names)
	want := []string{"block_hashes", "block_size", "group_idx", "locality", "lora_id", "lora_name", "medium", "parent_block_hash", "token_ids", "type"}
	if !slices.Equal(names, want) {
		t.Errorf("event fields %v, want %v", names, want)
	}
	if tok, ok := ev["token_ids"].([]any); !ok || len(tok) != 0 {
		t.Errorf("token_ids %#v, want []", ev["token_ids"])
	}
	for _, k := range []string{"parent_block_hash", "lora_id", "lora_name"} {
		if ev[k] != nil {
			t.Errorf("%s %v, want nil", k, ev[k])
		}
	}
	if ev["type"] != "BlockStored" || ev["medium"] != "STORAGE" || ev["locality"] != "REMOTE" {
		t.Errorf("event %v, want type BlockStored, medium STORAGE, locality REMOTE", ev)
	}
}

func TestBatchBySize(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{MaxBatch: 4, FlushEvery: time.Hour})
	kb := kvcore.KeyBuilder{Model: "m", Fingerprint: fp}
	stop := start(t, a)
	a.Stored(kb.Key(kvcore.Rank{}, 1, hashOf(100))) // another namespace, published with the full one
	for i := range 4 {
		a.Stored(kb.Key(kvcore.Rank{}, 0, hashOf(i)))
	}
	a.Stored(kb.Key(kvcore.Rank{}, 0, hashOf(4))) // starts the next batch
	eventually(t, "the full batch", func() bool { return len(pub.messages()) == 2 })
	recs := pub.records(t)
	if recs[0].Namespace != kb.Namespace(kvcore.Rank{}, 1) || len(recs[0].Hashes) != 1 ||
		recs[1].Namespace != kb.Namespace(kvcore.Rank{}, 0) || len(recs[1].Hashes) != 4 {
		t.Fatalf("records %v / %v, want the group-1 key then the four group-0 keys", recs[0].Keys(), recs[1].Keys())
	}
	if g := *recs[0].Batch.Events[0].GroupIdx; g != 1 {
		t.Errorf("group_idx %d, want 1", g)
	}
	stop() // the final flush publishes the fifth key
	recs = pub.records(t)
	if len(recs) != 3 || !slices.Equal(recs[2].Hashes, []string{hashOf(4).Hex()}) {
		t.Fatalf("after stop %d records, want a third with the fifth key", len(recs))
	}
	if got := testutil.ToFloat64(a.published.WithLabelValues(contract.MediumTier)); got != 6 {
		t.Errorf("published_total %v, want 6", got)
	}
}

func TestBatchByTime(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{FlushEvery: 20 * time.Millisecond})
	kb := kvcore.KeyBuilder{Model: "m", Fingerprint: fp}
	start(t, a)
	want := map[string][]string{}
	for i := range 5 {
		g := i % 2
		a.Stored(kb.Key(kvcore.Rank{}, g, hashOf(i)))
		ns := kb.Namespace(kvcore.Rank{}, g)
		want[ns] = append(want[ns], hashOf(i).Hex())
	}
	eventually(t, "the timed flush", func() bool { return pub.blocks(t) == 5 })
	got := map[string][]string{}
	for _, r := range pub.records(t) {
		got[r.Namespace] = append(got[r.Namespace], r.Hashes...)
	}
	if len(got) != 2 || !slices.Equal(got[kb.Namespace(kvcore.Rank{}, 0)], want[kb.Namespace(kvcore.Rank{}, 0)]) ||
		!slices.Equal(got[kb.Namespace(kvcore.Rank{}, 1)], want[kb.Namespace(kvcore.Rank{}, 1)]) {
		t.Fatalf("published %v, want %v", got, want)
	}
	// A later key is published on its own timer.
	a.Stored(kb.Key(kvcore.Rank{}, 0, hashOf(99)))
	eventually(t, "the second timed flush", func() bool { return pub.blocks(t) == 6 })
}

func TestRecordsSplitAtMaxBatch(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{MaxBatch: 3, FlushEvery: time.Hour})
	kb := kvcore.KeyBuilder{Model: "m", Fingerprint: fp}
	for i := range 7 { // queued before Run: the final flush takes them all
		a.Stored(kb.Key(kvcore.Rank{}, 0, hashOf(i)))
	}
	start(t, a)()
	var sizes []int
	for _, r := range pub.records(t) {
		sizes = append(sizes, len(r.Hashes))
	}
	if !slices.Equal(sizes, []int{3, 3, 1}) {
		t.Fatalf("record sizes %v, want [3 3 1]", sizes)
	}
}

func TestUnparsableKeysCounted(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{})
	kb := kvcore.KeyBuilder{Model: "m", Fingerprint: fp}
	good := kb.Key(kvcore.Rank{}, 0, hashOf(1))
	bad := []string{
		"",
		"no-separator",
		"trailing@",
		"@leading",
		"a@b",                         // too few fields
		"m@tp0@pcp0@dcp0@pp0@g0@zz",   // not hex
		"m@tp0@pcp0@dcp0@pp0@g0@ABCD", // not lower-case hex
		"m@tp0@pcp0@dcp0@pp0@gx@abcd", // group not a number
		strings.TrimSuffix(good, "@"+hashOf(1).Hex()) + "@", // no hash
	}
	for _, k := range bad {
		a.Stored(k)
	}
	a.Stored(good)
	start(t, a)()
	if n := dropped(a, DropUnparsable); n != len(bad) {
		t.Errorf("dropped{unparsable} %d, want %d", n, len(bad))
	}
	recs := pub.records(t)
	if len(recs) != 1 || !slices.Equal(recs[0].Keys(), []string{good}) {
		t.Fatalf("published %d records, want one of %s", len(recs), good)
	}
	if got := testutil.ToFloat64(a.published.WithLabelValues(contract.MediumTier)); got != 1 {
		t.Errorf("published_total %v, want 1", got)
	}
}

func TestQueueFullCounted(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{Queue: 2})
	kb := kvcore.KeyBuilder{Model: "m", Fingerprint: fp}
	for i := range 5 { // nothing reads the queue yet: Stored must not block
		a.Stored(kb.Key(kvcore.Rank{}, 0, hashOf(i)))
	}
	if n := dropped(a, DropQueueFull); n != 3 {
		t.Errorf("dropped{queue_full} %d, want 3", n)
	}
	start(t, a)()
	if n := pub.blocks(t); n != 2 {
		t.Errorf("published %d blocks, want the 2 queued", n)
	}
}

func TestPublishRetried(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{fail: func(call int) error {
		if call <= 2 {
			return errors.New("broker down")
		}
		return nil
	}}
	a := newAnnouncer(t, pub, Options{FlushEvery: time.Millisecond})
	start(t, a)
	a.Stored(kvcore.KeyBuilder{Model: "m", Fingerprint: fp}.Key(kvcore.Rank{}, 0, hashOf(1)))
	eventually(t, "the retried publish", func() bool { return pub.blocks(t) == 1 })
	if n := dropped(a, DropPublishFailed); n != 0 {
		t.Errorf("dropped{publish_failed} %d, want 0", n)
	}
}

func TestPublishFailedCounted(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{fail: func(int) error { return errors.New("broker down") }}
	a := newAnnouncer(t, pub, Options{FlushEvery: time.Hour})
	a.finalTimeout = 20 * time.Millisecond
	for i := range 3 {
		a.Stored(kvcore.KeyBuilder{Model: "m", Fingerprint: fp}.Key(kvcore.Rank{}, 0, hashOf(i)))
	}
	start(t, a)()
	if n := dropped(a, DropPublishFailed); n != 3 {
		t.Errorf("dropped{publish_failed} %d, want 3", n)
	}
	if got := testutil.ToFloat64(a.published.WithLabelValues(contract.MediumTier)); got != 0 {
		t.Errorf("published_total %v, want 0", got)
	}
}

func TestStoredConcurrently(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{MaxBatch: 64, FlushEvery: 5 * time.Millisecond})
	start(t, a)
	const writers, each = 8, 500
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			kb := kvcore.KeyBuilder{Model: "m", Fingerprint: fp}
			for i := range each {
				a.Stored(kb.Key(kvcore.Rank{}, w%3, hashOf(w*each+i)))
			}
		})
	}
	wg.Wait()
	eventually(t, "every key", func() bool { return pub.blocks(t) == writers*each })
	seen := map[string]bool{}
	for _, r := range pub.records(t) {
		if len(r.Hashes) > 64 {
			t.Fatalf("record of %d blocks, want at most 64", len(r.Hashes))
		}
		for _, k := range r.Keys() {
			if seen[k] {
				t.Fatalf("%s announced twice", k)
			}
			seen[k] = true
		}
	}
	if got := testutil.ToFloat64(a.published.WithLabelValues(contract.MediumTier)); got != writers*each {
		t.Errorf("published_total %v, want %d", got, writers*each)
	}
}

func TestNewOptions(t *testing.T) {
	t.Parallel()
	if _, err := New(Options{}); !errors.Is(err, ErrOptions) {
		t.Errorf("New without a publisher = %v, want ErrOptions", err)
	}
	if _, err := New(Options{Publisher: &fakePublisher{}, Form: "json"}); !errors.Is(err, ErrOptions) {
		t.Errorf("New with form json = %v, want ErrOptions", err)
	}
	reg := prometheus.NewRegistry()
	for i := range 2 { // a second announcer shares the families
		if _, err := New(Options{Publisher: &fakePublisher{}, Registry: reg}); err != nil {
			t.Fatalf("New #%d on one registry: %v", i+1, err)
		}
	}
	n, err := testutil.GatherAndCount(reg, "kvmesh_gpuworker_tier_events_published_total", "kvmesh_gpuworker_tier_events_dropped_total")
	if err != nil || n != 5 {
		t.Errorf("gathered %d series (%v), want published of two media and three drop reasons", n, err)
	}
	a, err := New(Options{Publisher: &fakePublisher{}})
	if err != nil {
		t.Fatal(err)
	}
	if a.opts.Form != contract.KVEventFormMap || a.opts.MaxBatch != DefaultMaxBatch || a.opts.FlushEvery != DefaultFlushEvery ||
		cap(a.queue) != DefaultQueue {
		t.Errorf("defaults %+v, queue %d", a.opts, cap(a.queue))
	}
}

// TestPromotedAnnouncedInRedis: keys promoted back into Redis become
// placeholders of medium CPU, batched apart from the same namespace's
// STORAGE placeholders and counted by medium.
func TestPromotedAnnouncedInRedis(t *testing.T) {
	t.Parallel()
	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{})
	kb := kvcore.KeyBuilder{Model: "llama", Fingerprint: fp}
	a.Stored(kb.Key(kvcore.Rank{}, 0, hashOf(1)))
	a.Promoted([]string{kb.Key(kvcore.Rank{}, 0, hashOf(1)), kb.Key(kvcore.Rank{}, 0, hashOf(2))})
	a.drain()
	a.flush(t.Context(), true)
	recs := pub.records(t)
	if len(recs) != 2 {
		t.Fatalf("%d records, want one per medium", len(recs))
	}
	for i, want := range []struct {
		medium string
		hashes []kvcore.BlockHash
	}{{contract.MediumTier, []kvcore.BlockHash{hashOf(1)}}, {contract.MediumStore, []kvcore.BlockHash{hashOf(1), hashOf(2)}}} {
		r := recs[i]
		if len(r.Batch.Events) != len(want.hashes) {
			t.Fatalf("record %d: %d events, want %d", i, len(r.Batch.Events), len(want.hashes))
		}
		for j, e := range r.Batch.Events {
			if e.Medium == nil || *e.Medium != want.medium || !slices.Equal(e.BlockHashes, []uint64{contract.WireHash(want.hashes[j])}) ||
				len(e.TokenIDs) != 0 || e.ParentBlockHash != nil {
				t.Errorf("record %d event %d: %+v, want a placeholder of %s in medium %s", i, j, e, want.hashes[j].Hex(), want.medium)
			}
		}
	}
	for medium, want := range map[string]float64{contract.MediumTier: 1, contract.MediumStore: 2} {
		if got := testutil.ToFloat64(a.published.WithLabelValues(medium)); got != want {
			t.Errorf("published{medium=%q} = %v, want %v", medium, got, want)
		}
	}
}
