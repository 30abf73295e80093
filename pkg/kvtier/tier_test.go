package kvtier_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/kvstoretest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// fp is the fingerprint the test values are framed with.
const fp = "0123456789abcdef"

func TestParseURL(t *testing.T) {
	tests := []struct {
		in   string
		want kvtier.Location
		bad  bool
	}{
		{in: "http://127.0.0.1:7070/kv", want: kvtier.Location{Endpoint: "127.0.0.1:7070", Bucket: "kv"}},
		{in: "https://s3.example.com/kv/fleet-a/", want: kvtier.Location{Endpoint: "s3.example.com", Secure: true, Bucket: "kv", Prefix: "fleet-a/"}},
		{in: "http://h:1/kv/a/b", want: kvtier.Location{Endpoint: "h:1", Bucket: "kv", Prefix: "a/b/"}},
		{in: "s3://kv/x", bad: true},
		{in: "http://h:1/", bad: true},
		{in: "http://user:pw@h:1/kv", bad: true},
		{in: "http://h:1/kv?region=x", bad: true},
		{in: "", bad: true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := kvtier.ParseURL(tt.in)
			if tt.bad {
				if !errors.Is(err, kvtier.ErrBadURL) {
					t.Fatalf("ParseURL(%q) = %+v, %v; want ErrBadURL", tt.in, got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseURL(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
			}
		})
	}
}

// rig is a Tier over a private redis-server and a private versitygw.
type rig struct {
	s3    *testenv.S3Server
	redis *kvstore.Redis
	obj   *kvtier.Objects
	tier  *kvtier.Tier
	reg   *prometheus.Registry
}

func newRig(t *testing.T, opts kvtier.Options) *rig {
	t.Helper()
	ctx := context.Background()
	s3 := testenv.StartS3(t)
	rs := testenv.StartRedis(t)
	redis, err := kvstore.NewRedis(ctx, rs.URL(), kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = redis.Close() })
	obj := openObjects(t, s3, s3.URL())
	reg := prometheus.NewRegistry()
	m, err := kvtier.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	tier := kvtier.New(redis, obj, m, opts)
	t.Cleanup(func() { _ = tier.Close() })
	return &rig{s3: s3, redis: redis, obj: obj, tier: tier, reg: reg}
}

func openObjects(t *testing.T, s3 *testenv.S3Server, url string) *kvtier.Objects {
	t.Helper()
	obj, err := kvtier.Open(context.Background(), kvtier.Config{URL: url, AccessKey: s3.AccessKey(), SecretKey: s3.SecretKey(), Timeout: 2 * time.Second})
	if err != nil {
		t.Fatalf("open the tier: %v", err)
	}
	return obj
}

// counter reads one series of a tier counter.
func (r *rig) counter(t *testing.T, name, result string) float64 {
	t.Helper()
	fams, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == result {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// values are n framed test values under keys of prefix.
func values(prefix string, n int) []kvstore.Item {
	items := make([]kvstore.Item, n)
	for i := range items {
		payload := bytes.Repeat([]byte{byte(i + 1)}, 4096+i)
		items[i] = kvstore.Item{Key: fmt.Sprintf("%s@fp:%s@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@%016x", prefix, fp, i+1), Value: dataplane.EncodeValue(fp, payload)}
	}
	return items
}

func keysOf(items []kvstore.Item) []string {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	return keys
}

// verify is a loader's check: the fingerprint and checksum of a framed value.
func verify(value []byte) error {
	_, err := dataplane.DecodeValue(fp, value)
	return err
}

// getEach runs GetEach with verify as the check and returns the per-key
// errors and the values it accepted.
func getEach(t *testing.T, st kvstore.Store, keys []string) ([]error, map[int][]byte) {
	t.Helper()
	got := map[int][]byte{}
	errs, err := kvstore.GetEach(context.Background(), st, keys, func(i int, v []byte) error {
		if err := verify(v); err != nil {
			return err
		}
		got[i] = bytes.Clone(v)
		return nil
	})
	if err != nil {
		t.Fatalf("GetEach: %v", err)
	}
	return errs, got
}

func drain(t *testing.T, tier *kvtier.Tier) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := tier.Drain(ctx); err != nil {
		t.Fatal(err)
	}
}

// flush empties Redis, as an operator's FLUSHALL or a restart without
// persistence would.
func flush(t *testing.T, r *rig, keys []string) {
	t.Helper()
	if _, err := r.redis.Remove(context.Background(), keys); err != nil {
		t.Fatal(err)
	}
	found, err := r.redis.Exists(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range found {
		if ok {
			t.Fatalf("key %d still in Redis after the flush", i)
		}
	}
}

// TestTierOutlivesRedis: blocks written behind Redis survive its flush,
// count present once their objects are confirmed, load through the
// reader's checks and are promoted back into Redis.
func TestTierOutlivesRedis(t *testing.T) {
	r := newRig(t, kvtier.Options{})
	ctx := context.Background()
	items := values("outlive", 12)
	keys := keysOf(items)
	sortedKeys := slices.Sorted(slices.Values(keys))
	var mu sync.Mutex
	var seen []string
	r.tier.OnPromoted(func(_ context.Context, keys []string) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, keys...)
	})
	promoted := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Sorted(slices.Values(seen))
	}
	errs, err := r.tier.Put(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range errs {
		if e != nil {
			t.Fatalf("put %d: %v", i, e)
		}
	}
	drain(t, r.tier)
	if got := r.counter(t, kvtier.MetricWrites, "stored"); got != float64(len(items)) {
		t.Fatalf("writes stored = %v, want %d", got, len(items))
	}
	flush(t, r, keys)
	absent := "outlive-never@fp:" + fp + "@group:0@00000000000000ff"
	found, err := r.tier.Exists(ctx, append(keys, absent))
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range found[:len(keys)] {
		if !ok {
			t.Fatalf("key %d not confirmed in the tier after the flush", i)
		}
	}
	if found[len(keys)] {
		t.Fatal("a key never stored counts present")
	}
	gotErrs, got := getEach(t, r.tier, keys)
	for i := range keys {
		if gotErrs[i] != nil || !bytes.Equal(got[i], items[i].Value) {
			t.Fatalf("key %d: err %v, %d bytes; want its value", i, gotErrs[i], len(got[i]))
		}
	}
	if got := r.counter(t, kvtier.MetricReads, "hit"); got != float64(len(keys)) {
		t.Fatalf("reads hit = %v, want %d", got, len(keys))
	}
	drain(t, r.tier) // promotions run in the background
	inRedis, err := r.redis.Exists(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range inRedis {
		if !ok {
			t.Fatalf("key %d not promoted into Redis", i)
		}
	}
	if got := r.counter(t, kvtier.MetricPromoted, "stored"); got != float64(len(keys)) {
		t.Fatalf("promoted = %v, want %d", got, len(keys))
	}
	if got := promoted(); !slices.Equal(got, sortedKeys) {
		t.Fatalf("OnPromoted saw %d keys, want the %d promoted", len(got), len(keys))
	}
	// A load of blocks Redis holds again promotes nothing.
	if errs, _ := getEach(t, r.tier, keys); errors.Join(errs...) != nil {
		t.Fatal(errs)
	}
	drain(t, r.tier)
	if got := promoted(); len(got) != len(keys) {
		t.Fatalf("OnPromoted saw %d keys after a load from Redis, want still %d", len(got), len(keys))
	}
	// A remove takes the block from both tiers.
	rmErrs, err := r.tier.Remove(ctx, keys[:1])
	if err != nil || rmErrs[0] != nil {
		t.Fatalf("remove: %v %v", err, rmErrs)
	}
	if err := r.obj.Head(ctx, keys[0]); !errors.Is(err, kvtier.ErrNotFound) {
		t.Fatalf("head after remove: %v, want ErrNotFound", err)
	}
}

// TestTierFailsClosed: every way the object tier can fail gives a load
// error (never the wrong bytes, never a promotion) and an existence check
// of absent.
func TestTierFailsClosed(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// spoil spoils object i of keys (or the whole tier) after the flush.
		spoil func(t *testing.T, r *rig, keys []string)
		// present is whether the spoilt key still counts present (its
		// object is confirmed whole and of its key; only its bytes are
		// wrong, which the load's checks find).
		present bool
		want    error
	}{
		{name: "altered", present: true, want: dataplane.ErrChecksum, spoil: func(t *testing.T, r *rig, keys []string) {
			path := r.s3.ObjectFile(r.obj.Name(keys[0]))
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			b[len(b)-7] ^= 0x5a
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "truncated", present: true, want: dataplane.ErrFrame, spoil: func(t *testing.T, r *rig, keys []string) {
			path := r.s3.ObjectFile(r.obj.Name(keys[0]))
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(path, fi.Size()/2); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "another key's object", want: kvtier.ErrForeign, spoil: func(t *testing.T, r *rig, keys []string) {
			// The object of keys[1] copied under keys[0]'s name, metadata
			// and all: its bytes pass every check of the value itself.
			src := minio.CopySrcOptions{Bucket: r.obj.Location().Bucket, Object: r.obj.Name(keys[1])}
			dst := minio.CopyDestOptions{Bucket: r.obj.Location().Bucket, Object: r.obj.Name(keys[0])}
			if _, err := r.obj.Client().CopyObject(ctx, dst, src); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "down", want: kvtier.ErrUnavailable, spoil: func(t *testing.T, r *rig, keys []string) {
			r.s3.Stop()
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRig(t, kvtier.Options{})
			items := values("spoil", 3)
			keys := keysOf(items)
			if _, err := r.tier.Put(ctx, items); err != nil {
				t.Fatal(err)
			}
			drain(t, r.tier)
			flush(t, r, keys)
			tt.spoil(t, r, keys)
			found, err := r.tier.Exists(ctx, keys[:1])
			if err != nil {
				t.Fatal(err)
			}
			if found[0] != tt.present {
				t.Fatalf("spoilt key present = %v, want %v", found[0], tt.present)
			}
			errs, got := getEach(t, r.tier, keys[:1])
			if !errors.Is(errs[0], tt.want) {
				t.Fatalf("load of the spoilt key: %v, want %v", errs[0], tt.want)
			}
			if _, ok := got[0]; ok {
				t.Fatal("the spoilt value reached the reader")
			}
			drain(t, r.tier)
			inRedis, err := r.redis.Exists(ctx, keys[:1])
			if err != nil || inRedis[0] {
				t.Fatalf("spoilt value promoted into Redis (%v)", err)
			}
			if tt.present { // a value the reader refused is removed from the tier
				if err := r.obj.Head(ctx, keys[0]); !errors.Is(err, kvtier.ErrNotFound) {
					t.Fatalf("the refused object is still there: %v", err)
				}
			}
		})
	}
}

// TestTierSlow: an object store slower than the tier's timeout fails the
// calls in time: the load is an error, the block counts absent.
func TestTierSlow(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, kvtier.Options{})
	items := values("slow", 2)
	keys := keysOf(items)
	if _, err := r.tier.Put(ctx, items); err != nil {
		t.Fatal(err)
	}
	drain(t, r.tier)
	flush(t, r, keys)
	proxy := testenv.StartDelayProxy(t, r.s3.Addr())
	slow := openObjects(t, r.s3, "http://"+proxy.Addr()+"/"+r.s3.Bucket())
	m, err := kvtier.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	tier := kvtier.New(r.redis, slow, m, kvtier.Options{})
	t.Cleanup(func() { _ = tier.Close() })
	proxy.SetDelay(5 * time.Second) // over the 2 s timeout
	start := time.Now()
	found, err := tier.Exists(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	if found[0] || found[1] {
		t.Fatalf("blocks behind a stalled tier count present: %v", found)
	}
	errs, got := getEach(t, tier, keys)
	for i := range keys {
		if !errors.Is(errs[i], kvtier.ErrUnavailable) || got[i] != nil {
			t.Fatalf("key %d behind a stalled tier: %v", i, errs[i])
		}
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("the stalled tier held the calls %s", took)
	}
}

// TestTierDropsWhenQueueFull: a copy that does not fit the write-behind
// queue is dropped and counted; the put itself succeeds (Redis holds it).
func TestTierDropsWhenQueueFull(t *testing.T) {
	r := newRig(t, kvtier.Options{QueueBytes: 6000, Writers: 1})
	items := values("full", 4) // each value is over 4 KiB
	errs, err := r.tier.Put(context.Background(), items)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range errs {
		if e != nil {
			t.Fatalf("put %d: %v", i, e)
		}
	}
	drain(t, r.tier)
	stored, dropped := r.counter(t, kvtier.MetricWrites, "stored"), r.counter(t, kvtier.MetricWrites, "dropped")
	if stored < 1 || dropped < 1 || stored+dropped != float64(len(items)) {
		t.Fatalf("stored %v + dropped %v, want both and %d in all", stored, dropped, len(items))
	}
}

// TestTierRemoveBeforeWriteBehind: a key removed while its copy waits in
// the queue is not left in the bucket.
func TestTierRemoveBeforeWriteBehind(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, kvtier.Options{Writers: 1})
	items := values("gone", 40)
	keys := keysOf(items)
	if _, err := r.tier.Put(ctx, items); err != nil {
		t.Fatal(err)
	}
	if _, err := r.tier.Remove(ctx, keys); err != nil {
		t.Fatal(err)
	}
	drain(t, r.tier)
	found, err := r.tier.Exists(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range found {
		if ok {
			t.Fatalf("key %d removed before its copy was written is still present", i)
		}
	}
}

// TestTierContract: the Tier is a kvstore.Store like any other.
func TestTierContract(t *testing.T) {
	s3 := testenv.StartS3(t)
	rs := testenv.StartRedis(t)
	kvstoretest.RunContractTests(t, func(t *testing.T) kvstore.Store {
		redis, err := kvstore.NewRedis(context.Background(), rs.URL(), kvstore.RedisOptions{})
		if err != nil {
			t.Fatal(err)
		}
		m, err := kvtier.NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		tier := kvtier.New(redis, openObjects(t, s3, s3.URL()), m, kvtier.Options{})
		t.Cleanup(func() { _ = tier.Close(); _ = redis.Close() })
		return tier
	})
}

// firstOnly is a Prober that asks about key 0 only, once.
type firstOnly struct{ calls int }

func (p *firstOnly) Probe(found, tried []bool, _ int) []int {
	p.calls++
	if found[0] || tried[0] {
		return nil
	}
	return []int{0}
}

// TestTierExistsAsksWhatTheProberChooses: under a Prober, only the keys
// it chooses are confirmed in the bucket; the others count absent even
// where the bucket holds them.
func TestTierExistsAsksWhatTheProberChooses(t *testing.T) {
	ctx := context.Background()
	r := newRig(t, kvtier.Options{})
	items := values("probe", 3)
	keys := keysOf(items)
	if _, err := r.tier.Put(ctx, items); err != nil {
		t.Fatal(err)
	}
	drain(t, r.tier)
	flush(t, r, keys)
	pr := &firstOnly{}
	found, err := r.tier.Exists(kvtier.WithProber(ctx, pr), keys)
	if err != nil {
		t.Fatal(err)
	}
	if !found[0] || found[1] || found[2] {
		t.Fatalf("found %v, want only the key the prober chose", found)
	}
	if got := r.counter(t, kvtier.MetricConfirms, "present"); got != 1 {
		t.Fatalf("%v confirmations, want 1", got)
	}
	if pr.calls != 2 {
		t.Fatalf("prober asked %d times, want 2 (a round, then done)", pr.calls)
	}
}

// TestTierRecyclesBuffers: the tier's own buffers are reused (write-behind
// copies, values read from the bucket), so neither a caller reusing its
// value buffer after Put (as a gpuworker does) nor loads running while
// earlier promotions wait may change a byte of what reaches the bucket or
// Redis.
func TestTierRecyclesBuffers(t *testing.T) {
	r := newRig(t, kvtier.Options{})
	ctx := context.Background()
	items := values("recycle", 48)
	keys := keysOf(items)
	scratch := make([]byte, 0, 8192)
	for _, it := range items { // one buffer for every put, overwritten after each
		scratch = append(scratch[:0], it.Value...)
		errs, err := r.tier.Put(ctx, []kvstore.Item{{Key: it.Key, Value: scratch}})
		if err != nil || errs[0] != nil {
			t.Fatalf("put %s: %v %v", it.Key, err, errs)
		}
		for i := range scratch {
			scratch[i] = 0xEE
		}
	}
	drain(t, r.tier)
	for i, k := range keys {
		v, err := r.obj.Get(ctx, k)
		if err != nil || !bytes.Equal(v, items[i].Value) {
			t.Fatalf("object %d: %d bytes, %v; want its value as put", i, len(v), err)
		}
	}
	flush(t, r, keys)
	// Loads of 4 keys, 6 at once, twice over: the second round's loads
	// read into buffers while the first round's promotions may still wait.
	for round := range 2 {
		var g errgroup.Group
		for lo := 0; lo < len(keys); lo += 4 {
			g.Go(func() error {
				errs, err := r.tier.GetEach(ctx, keys[lo:lo+4], func(j int, v []byte) error {
					if !bytes.Equal(v, items[lo+j].Value) {
						return fmt.Errorf("round %d key %d: %d other bytes", round, lo+j, len(v))
					}
					return nil
				})
				if err == nil {
					err = errors.Join(errs...)
				}
				return err
			})
		}
		if err := g.Wait(); err != nil {
			t.Fatal(err)
		}
	}
	drain(t, r.tier)
	got, errs, err := r.redis.Get(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i := range keys {
		if errs[i] != nil || !bytes.Equal(got[i], items[i].Value) {
			t.Fatalf("Redis holds %d bytes for key %d (%v); want the value promoted unchanged", len(got[i]), i, errs[i])
		}
	}
}
