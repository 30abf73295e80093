package kvtier_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// Object-tier benchmark sizes: 64 framed values of a 1 MiB payload per
// round, moved in calls of 4 keys with 4 calls in flight (the gpuworker's
// sub-batches: its 4 MiB chunks hold 3 to 4 such blocks, DefaultStreams 4
// at once), timed rounds per operation after an untimed warm-up round: 9
// of a save (each some 250 ms) and 31 of a load (each some 40 ms, so more
// of them for a median that holds still on a shared machine).
const (
	tierBenchValues     = 64
	tierBenchPayload    = 1 << 20
	tierBenchBatch      = 4
	tierBenchStreams    = 4
	tierBenchSaveRounds = 9
	tierBenchLoadRounds = 31
)

// benchRig is a Tier over a private redis-server and a private versitygw,
// for benchmarks.
type benchRig struct {
	redisURL string
	redis    *kvstore.Redis
	obj      *kvtier.Objects
	tier     *kvtier.Tier
	// stored counts the keys the tier's writers stored (OnStored).
	stored atomic.Int64
}

func newBenchRig(b *testing.B) *benchRig {
	b.Helper()
	ctx := context.Background()
	s3 := testenv.StartS3(b)
	rs := testenv.StartRedis(b)
	r := &benchRig{redisURL: rs.URL()}
	r.redis = benchRedis(b, r.redisURL)
	obj, err := kvtier.Open(ctx, kvtier.Config{URL: s3.URL(), AccessKey: s3.AccessKey(), SecretKey: s3.SecretKey()})
	if err != nil {
		b.Fatalf("open the tier: %v", err)
	}
	r.obj = obj
	r.tier = benchTier(b, r.redis, obj, kvtier.Options{})
	r.tier.OnStored(func(string) { r.stored.Add(1) })
	return r
}

// benchRedis is a store client of the redis-server at url.
func benchRedis(b *testing.B, url string) *kvstore.Redis {
	b.Helper()
	redis, err := kvstore.NewRedis(context.Background(), url, kvstore.RedisOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = redis.Close() })
	return redis
}

// benchTier is a Tier over hot and obj with metrics of its own; closing it
// closes hot.
func benchTier(b *testing.B, hot kvstore.Store, obj *kvtier.Objects, opts kvtier.Options) *kvtier.Tier {
	b.Helper()
	m, err := kvtier.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	tier := kvtier.New(hot, obj, m, opts)
	b.Cleanup(func() { _ = tier.Close() })
	return tier
}

// acceptingStore is a hot store that accepts every put and keeps nothing.
type acceptingStore struct{}

func (acceptingStore) Exists(_ context.Context, keys []string) ([]bool, error) {
	return make([]bool, len(keys)), nil
}

func (acceptingStore) Put(_ context.Context, items []kvstore.Item) ([]error, error) {
	return make([]error, len(items)), nil
}

func (acceptingStore) Get(_ context.Context, keys []string) ([][]byte, []error, error) {
	errs := make([]error, len(keys))
	for i := range errs {
		errs[i] = kvstore.ErrNotFound
	}
	return make([][]byte, len(keys)), errs, nil
}

func (s acceptingStore) Remove(ctx context.Context, keys []string) ([]error, error) {
	_, errs, err := s.Get(ctx, keys)
	return errs, err
}

func (acceptingStore) Ping(context.Context) error { return nil }
func (acceptingStore) Close() error               { return nil }

// benchItems are n framed values of a random 1 MiB payload each, under
// keys of the mesh's shape.
func benchItems(prefix string, n int) []kvstore.Item {
	items := make([]kvstore.Item, n)
	for i := range items {
		payload := make([]byte, tierBenchPayload)
		_, _ = rand.Read(payload) // crypto/rand.Read never fails
		items[i] = kvstore.Item{
			Key:   fmt.Sprintf("%s@fp:%s@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@%016x", prefix, fp, i+1),
			Value: dataplane.EncodeValue(fp, payload),
		}
	}
	return items
}

// totalBytes is the value bytes of items.
func totalBytes(items []kvstore.Item) int {
	n := 0
	for _, it := range items {
		n += len(it.Value)
	}
	return n
}

// parallel calls do(i) for i in [0, n), limit at once, and returns the
// first error.
func parallel(n, limit int, do func(i int) error) error {
	var g errgroup.Group
	g.SetLimit(limit)
	for i := range n {
		g.Go(func() error { return do(i) })
	}
	return g.Wait()
}

// inBatches calls do with the bounds of each run of batch indices of
// [0, n), streams calls at once, and returns the first error.
func inBatches(n, batch, streams int, do func(lo, hi int) error) error {
	return parallel((n+batch-1)/batch, streams, func(j int) error {
		return do(j*batch, min((j+1)*batch, n))
	})
}

// benchSide is one way of moving a round's bytes: prep runs untimed before
// each run, run is timed, check (when set) runs untimed after it.
type benchSide struct {
	name             string
	prep, run, check func() error
}

// benchRounds runs every side once untimed (connections, server caches,
// the bucket's directories), then the given rounds per b.Loop
// iteration, the side that goes first rotating from round to round so that
// none always finds the machine in the same state. It returns each side's
// timed runs.
func benchRounds(b *testing.B, rounds int, sides []benchSide) [][]time.Duration {
	b.Helper()
	untimed := func(name string, f func() error) {
		if f == nil {
			return
		}
		b.StopTimer()
		defer b.StartTimer()
		if err := f(); err != nil {
			b.Fatalf("%s: %v", name, err)
		}
	}
	once := func(s benchSide) time.Duration {
		untimed(s.name+": prepare", s.prep)
		start := time.Now()
		if err := s.run(); err != nil {
			b.Fatalf("%s: %v", s.name, err)
		}
		took := time.Since(start)
		untimed(s.name+": check", s.check)
		return took
	}
	for _, s := range sides {
		once(s)
	}
	took := make([][]time.Duration, len(sides))
	round := 0
	for b.Loop() {
		for range rounds {
			for k := range sides {
				i := (round + k) % len(sides)
				took[i] = append(took[i], once(sides[i]))
			}
			round++
		}
	}
	return took
}

// mibps is size bytes over the median of took, in MiB/s.
func mibps(size int, took []time.Duration) float64 {
	s := slices.Clone(took)
	slices.Sort(s)
	median := s[len(s)/2]
	if len(s)%2 == 0 {
		median = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return float64(size) / (1 << 20) / median.Seconds()
}

// BenchmarkTierSave1M writes 64 framed values of 1 MiB through the object
// tier's write-behind as the gpuworkers' puts feed it: Tier.Put in calls
// of 4 keys, 4 calls at once, over a hot store that accepts every value
// and keeps none (the Redis put is the mesh's own save, measured by
// BenchmarkSaveThroughput; here the tier's part is timed: the copy into
// the queue and the writers' PUTs with the key's metadata), then
// Tier.Drain until the writers (DefaultWriters) have stored every copy in
// the bucket. Against it, the raw minio-go client PUTs the same values
// under other object names, DefaultWriters at once, with the tier's
// transfer options (single PUT, unsigned payload: the cheapest plain PUT
// the client makes). Before each round every key is absent from the bucket
// (untimed), so both sides write new objects. It reports MiB/s (bytes
// reaching the bucket over the wall time from the first Put to Drain's
// return; the median round), raw_MiB/s (the median raw round) and ratio,
// and stored_MiB/s (to the moment the writers stored the last object,
// without Drain's polling).
func BenchmarkTierSave1M(b *testing.B) {
	r := newBenchRig(b)
	// The tier's own part of a save: over a hot store that accepts every
	// value without keeping it, so neither the Redis put (the mesh's save,
	// measured by save_1m) nor an in-process store's copy is charged to it.
	r.tier = benchTier(b, acceptingStore{}, r.obj, kvtier.Options{})
	ctx := context.Background()
	items := benchItems("bench-save", tierBenchValues)
	keys := keysOf(items)
	size := totalBytes(items)
	client, bucket := r.obj.Client(), r.obj.Location().Bucket
	rawNames := make([]string, len(items))
	for i, k := range keys {
		rawNames[i] = r.obj.Name("raw/" + k)
	}
	reset := func() error {
		if _, err := r.tier.Remove(ctx, keys); err != nil {
			return err
		}
		return parallel(len(rawNames), kvtier.DefaultWriters, func(i int) error {
			return client.RemoveObject(ctx, bucket, rawNames[i], minio.RemoveObjectOptions{})
		})
	}
	var last time.Duration // when the tier's last object was stored, in the last tier run
	tier := func() error {
		start := time.Now()
		r.stored.Store(0)
		done := make(chan struct{})
		r.tier.OnStored(func(string) {
			if r.stored.Add(1) == int64(len(items)) {
				last = time.Since(start)
				close(done)
			}
		})
		err := inBatches(len(items), tierBenchBatch, tierBenchStreams, func(lo, hi int) error {
			errs, err := r.tier.Put(ctx, items[lo:hi])
			if err != nil {
				return err
			}
			for j, e := range errs {
				if e != nil {
					return fmt.Errorf("put %s: %w", keys[lo+j], e)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := r.tier.Drain(dctx); err != nil {
			return err
		}
		select {
		case <-done:
			return nil
		default:
			return fmt.Errorf("the writers stored %d of %d objects", r.stored.Load(), len(items))
		}
	}
	raw := func() error {
		return parallel(len(items), kvtier.DefaultWriters, func(i int) error {
			v := items[i].Value
			_, err := client.PutObject(ctx, bucket, rawNames[i], bytes.NewReader(v), int64(len(v)),
				minio.PutObjectOptions{DisableMultipart: true, DisableContentSha256: true}) // the tier's transfer options
			return err
		})
	}
	var stored []time.Duration
	took := benchRounds(b, tierBenchSaveRounds, []benchSide{
		{name: "raw PUT", prep: reset, run: raw},
		{name: "tier save", prep: reset, run: func() error {
			err := tier()
			stored = append(stored, last)
			return err
		}},
	})
	rawMiBps, tierMiBps := mibps(size, took[0]), mibps(size, took[1])
	b.ReportMetric(tierMiBps, "MiB/s")
	b.ReportMetric(rawMiBps, "raw_MiB/s")
	b.ReportMetric(tierMiBps/rawMiBps, "ratio")
	b.ReportMetric(mibps(size, stored[1:]), "stored_MiB/s") // stored[0]: the warm-up
}

// BenchmarkTierLoad1M reads 64 framed values of 1 MiB, written behind
// and then removed from Redis (so that only the bucket holds them), through
// Tier.GetEach as the gpuworker's loader does: calls of 4 keys, 4 at once
// (DefaultReaders objects in flight), each value checked with
// dataplane.DecodeValue (fingerprint and checksum) and promoted into Redis
// (in the background after the loads, as the tier does; the round ends
// when GetEach returns, as a load does).
// Against it, the raw minio-go client GETs the same objects, DefaultReaders
// at once, each body read into a buffer of its size kept across rounds (the
// raw client's best case) and handed to the same check: the check is the
// loader's, made on every value whichever store it comes from, so the ratio
// is what the tier adds to a load. Before each tier round the values are
// removed from Redis again (untimed). It reports MiB/s (the median round),
// raw_MiB/s, ratio, nopromote_MiB/s (the same load through a Tier with
// Options.NoPromote), promoted_MiB/s (each tier round to the moment its
// promotions are in Redis) and unchecked_raw_MiB/s (the raw GETs without
// the check).
func BenchmarkTierLoad1M(b *testing.B) {
	r := newBenchRig(b)
	ctx := context.Background()
	items := benchItems("bench-load", tierBenchValues)
	keys := keysOf(items)
	size := totalBytes(items)
	if _, err := r.tier.Put(ctx, items); err != nil {
		b.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := r.tier.Drain(dctx); err != nil {
		b.Fatal(err)
	}
	if n := r.stored.Load(); n != int64(len(items)) {
		b.Fatalf("the writers stored %d of %d objects", n, len(items))
	}
	nopromote := benchTier(b, benchRedis(b, r.redisURL), r.obj, kvtier.Options{NoPromote: true})
	evict := func() error {
		if _, err := r.redis.Remove(ctx, keys); err != nil {
			return err
		}
		found, err := r.redis.Exists(ctx, keys)
		if err != nil {
			return err
		}
		if i := slices.Index(found, true); i >= 0 {
			return fmt.Errorf("key %d still in Redis", i)
		}
		return nil
	}
	load := func(t *kvtier.Tier) error {
		var got atomic.Int64
		err := inBatches(len(keys), tierBenchBatch, tierBenchStreams, func(lo, hi int) error {
			errs, err := t.GetEach(ctx, keys[lo:hi], func(_ int, v []byte) error {
				if _, err := dataplane.DecodeValue(fp, v); err != nil {
					return err
				}
				got.Add(int64(len(v)))
				return nil
			})
			if err != nil {
				return err
			}
			for j, e := range errs {
				if e != nil {
					return fmt.Errorf("load %s: %w", keys[lo+j], e)
				}
			}
			return nil
		})
		if err == nil && got.Load() != int64(size) {
			err = fmt.Errorf("loaded %d of %d bytes", got.Load(), size)
		}
		return err
	}
	client, bucket := r.obj.Client(), r.obj.Location().Bucket
	rawBufs := make([][]byte, len(items)) // the raw side's best case: each body read into a buffer of its size, kept across rounds
	for i, it := range items {
		rawBufs[i] = make([]byte, len(it.Value))
	}
	raw := func(check bool) func() error {
		return func() error {
			return parallel(len(keys), kvtier.DefaultReaders, func(i int) error {
				obj, err := client.GetObject(ctx, bucket, r.obj.Name(keys[i]), minio.GetObjectOptions{})
				if err != nil {
					return err
				}
				defer obj.Close()
				if _, err := io.ReadFull(obj, rawBufs[i]); err != nil {
					return fmt.Errorf("raw GET %s: %w", keys[i], err)
				}
				if check {
					_, err = dataplane.DecodeValue(fp, rawBufs[i])
				}
				return err
			})
		}
	}
	var loaded time.Time // when the last promoting load's GetEach calls returned
	var promotedIn []time.Duration
	promoted := func() error { // the promoting load put every value back into Redis
		defer func() { promotedIn = append(promotedIn, time.Since(loaded)) }()
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := r.tier.Drain(dctx); err != nil { // nothing to write; a tier that promotes behind the load would finish here
			return err
		}
		found, err := r.redis.Exists(ctx, keys)
		if err != nil {
			return err
		}
		if i := slices.Index(found, false); i >= 0 {
			return fmt.Errorf("key %d not promoted into Redis", i)
		}
		return nil
	}
	took := benchRounds(b, tierBenchLoadRounds, []benchSide{
		{name: "raw GET", run: raw(true)},
		{name: "tier load", prep: evict, run: func() error {
			err := load(r.tier)
			loaded = time.Now()
			return err
		}, check: promoted},
		{name: "tier load without promotion", prep: evict, run: func() error { return load(nopromote) }},
		{name: "raw GET unchecked", run: raw(false)},
	})
	rawMiBps, tierMiBps := mibps(size, took[0]), mibps(size, took[1])
	b.ReportMetric(tierMiBps, "MiB/s")
	b.ReportMetric(rawMiBps, "raw_MiB/s")
	b.ReportMetric(tierMiBps/rawMiBps, "ratio")
	b.ReportMetric(mibps(size, took[2]), "nopromote_MiB/s")
	withPromotion := make([]time.Duration, len(took[1]))
	for i, d := range took[1] {
		withPromotion[i] = d + promotedIn[i+1] // promotedIn[0]: the warm-up
	}
	b.ReportMetric(mibps(size, withPromotion), "promoted_MiB/s")
	b.ReportMetric(mibps(size, took[3]), "unchecked_raw_MiB/s")
}
