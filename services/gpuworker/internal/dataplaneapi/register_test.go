package dataplaneapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/dataplaneapi"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// memFixture is a worker's pool of a two-group model behind the data
// plane and the kv-memory routes, storing into a real Redis under a key
// prefix of its own.
type memFixture struct {
	model  *kvcore.Model
	pool   *pool.Pool
	url    string
	client *dataplane.Client
	rdb    *redis.Client
	prefix string
}

func newMemFixture(t *testing.T) *memFixture {
	t.Helper()
	m, err := kvcore.ParseModel([]byte(`
name: kvmem-test
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 4096}
  - {kind: mamba, block_size: 16, bytes_per_block: 2048}
`))
	if err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(m, 8)
	if err != nil {
		t.Fatal(err)
	}
	met, err := metrics.New(prometheus.NewRegistry(), func() []pool.GroupStats { return nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	url := testenv.RedisURL(t)
	st, err := kvstore.NewRedis(context.Background(), url, kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	opt, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	r := chi.NewRouter()
	dataplaneapi.New(p, st, m.Fingerprint(), 4<<20, met).Mount(r)
	dataplaneapi.NewKVMemory(p, m).Mount(r)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	f := &memFixture{model: m, pool: p, url: srv.URL, client: dataplane.NewClient(srv.URL, srv.Client()), rdb: rdb, prefix: "kvmemtest-" + hashOf(t.Name())[:12]}
	t.Cleanup(func() { f.cleanKeys() })
	return f
}

// cleanKeys removes the fixture's keys from Redis.
func (f *memFixture) cleanKeys() {
	ctx := context.Background()
	keys, _ := f.rdb.Keys(ctx, f.prefix+"*").Result()
	if len(keys) > 0 {
		_ = f.rdb.Del(ctx, keys...).Err() // best effort: the prefix is the test's own
	}
}

// segment creates an engine segment of l in the test's temporary directory
// (never /dev/shm), removed at cleanup.
func (f *memFixture) segment(t *testing.T, l kvmem.Layout) *kvmem.Segment {
	t.Helper()
	seg, err := kvmem.Create(filepath.Join(t.TempDir(), "engine.kvmem"), l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Remove() })
	return seg
}

// register posts reg and returns the status and the answer's body.
func (f *memFixture) register(t *testing.T, reg any) (int, []byte) {
	t.Helper()
	body, _ := json.Marshal(reg)
	resp, err := http.Post(f.url+kvmem.PathKVMemory, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	_, _ = out.ReadFrom(resp.Body)
	return resp.StatusCode, out.Bytes()
}

// content is the bytes of a block of group g holding hash h.
func (f *memFixture) content(g int, h string) []byte {
	return bytes.Repeat([]byte(h[:16]), int(f.model.Groups[g].BytesPerBlock)/16)
}

// TestRegisterValidation: registrations that cannot be the served model's
// memory are refused with a problem naming the fault, and the pool keeps
// its memory; a valid one replaces it, and so does a re-registration.
func TestRegisterValidation(t *testing.T) {
	f := newMemFixture(t)
	good := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 6, Regions: []int64{1024, 1024, 2048}}, {Blocks: 6, Regions: []int64{2048}}}}
	seg := f.segment(t, good)
	other := f.segment(t, kvmem.ModelLayout(f.model, 6))
	junk := filepath.Join(t.TempDir(), "junk")
	if err := os.WriteFile(junk, make([]byte, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		reg    any
		status int
		detail string
	}{
		{"unknown kind", kvmem.Registration{Kind: "tmpfs", Path: seg.Path(), Layout: good}, 400, "kind"},
		{"relative path", kvmem.Registration{Kind: kvmem.KindShm, Path: "engine.kvmem", Layout: good}, 400, "absolute"},
		{"unclean path", kvmem.Registration{Kind: kvmem.KindShm, Path: "/dev/shm/../etc/x", Layout: good}, 400, "absolute"},
		{"a group short", kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: kvmem.Layout{Groups: good.Groups[:1]}}, 400, "1 groups"},
		{"regions off bytes_per_block", kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 6, Regions: []int64{1024}}, good.Groups[1]}}}, 400, "bytes_per_block"},
		{"no blocks", kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: kvmem.Layout{Groups: []kvmem.GroupLayout{{Regions: []int64{4096}}, good.Groups[1]}}}, 400, "0 blocks"},
		{"handles for shm", kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: good, Handles: [][]kvmem.CUDAHandle{{}}}, 400, "handles"},
		{"unknown field", map[string]any{"kind": "shm", "path": seg.Path(), "layout": good, "size": 1}, 400, ""},
		{"missing segment", kvmem.Registration{Kind: kvmem.KindShm, Path: filepath.Join(t.TempDir(), "none"), Layout: good}, 409, "no such file"},
		{"not a segment", kvmem.Registration{Kind: kvmem.KindShm, Path: junk, Layout: good}, 409, "magic"},
		{"another layout in the header", kvmem.Registration{Kind: kvmem.KindShm, Path: other.Path(), Layout: good}, 409, "layout"},
		{"cuda without cuda", kvmem.Registration{Kind: kvmem.KindCUDA, Path: seg.Path(), Layout: good,
			Handles: [][]kvmem.CUDAHandle{{{}, {}, {}}, {{}}}}, 501, "without CUDA"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, body := f.register(t, tc.reg)
			if status != tc.status || !strings.Contains(string(body), tc.detail) {
				t.Fatalf("status %d %s, want %d naming %q", status, body, tc.status, tc.detail)
			}
			if kind := f.pool.MemoryKind(); kind != kvmem.KindHeap {
				t.Fatalf("a refused registration left the pool on %s memory", kind)
			}
		})
	}
	reg := kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: good}
	for i, wantReplaced := range []string{kvmem.KindHeap, kvmem.KindShm} {
		status, body := f.register(t, reg)
		var ans kvmem.Registered
		if err := json.Unmarshal(body, &ans); status != 200 || err != nil || ans.Kind != kvmem.KindShm || ans.Path != seg.Path() ||
			ans.Replaced != wantReplaced || ans.RegisteredAt == nil || !ans.Layout.Equal(good) {
			t.Fatalf("registration %d: %d %s", i, status, body)
		}
	}
	cur, err := kvmem.Current(context.Background(), http.DefaultClient, f.url)
	if err != nil || cur.Kind != kvmem.KindShm || cur.Path != seg.Path() {
		t.Fatalf("GET %s = %+v, %v", kvmem.PathKVMemory, cur, err)
	}
	if got := f.pool.Blocks(); got[0] != 6 || got[1] != 6 {
		t.Fatalf("pool blocks after registration = %v, want the engine's 6", got)
	}
}

// TestRegistrationHoldsTheLock: the worker holds the segment's liveness
// lock while it is the pool's memory, so the engine's Mapped is true: a
// refused registration takes nothing, a registration of the same segment
// again keeps it held (the new lock is taken before the old memory is
// closed), and a registration of another segment releases it.
func TestRegistrationHoldsTheLock(t *testing.T) {
	f := newMemFixture(t)
	l := kvmem.ModelLayout(f.model, 6)
	seg, other := f.segment(t, l), f.segment(t, l)
	mapped := func(what string, s *kvmem.Segment, want bool) {
		t.Helper()
		if got, err := s.Mapped(); err != nil || got != want {
			t.Fatalf("%s: Mapped = %v, %v; want %v", what, got, err, want)
		}
	}
	mapped("before any registration", seg, false)
	reg := func(s *kvmem.Segment, layout kvmem.Layout, want int) {
		t.Helper()
		if status, body := f.register(t, kvmem.Registration{Kind: kvmem.KindShm, Path: s.Path(), Layout: layout}); status != want {
			t.Fatalf("registration of %s: %d %s, want %d", s.Path(), status, body, want)
		}
	}
	reg(seg, l, http.StatusOK)
	mapped("registered", seg, true)
	reg(other, kvmem.ModelLayout(f.model, 7), http.StatusConflict)
	mapped("after a refused registration", seg, true)
	mapped("the refused segment", other, false)
	reg(seg, l, http.StatusOK)
	mapped("registered again", seg, true)
	reg(other, l, http.StatusOK)
	mapped("replaced by another segment", seg, false)
	mapped("the replacing segment", other, true)
}

// TestEngineWritesArePut: the engine writes blocks straight into its
// registered segment (one group in three per-layer regions) and the put
// route stores them, byte-exact in Redis; the read route serves them; a
// block written into the worker's heap before the registration is gone.
func TestEngineWritesArePut(t *testing.T) {
	f := newMemFixture(t)
	ctx := context.Background()
	hs := []string{hashOf("a"), hashOf("b"), hashOf("heap")}
	if err := f.pool.WriteBytes(0, 5, dataplane.Identity{Hash: hs[2]}, f.content(0, hs[2])); err != nil {
		t.Fatal(err)
	}
	l := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 8, Regions: []int64{1024, 1024, 2048}}, {Blocks: 8, Regions: []int64{2048}}}}
	seg := f.segment(t, l)
	if status, body := f.register(t, kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: l}); status != 200 {
		t.Fatalf("register: %d %s", status, body)
	}
	eng := kvmem.NewEngineWriter(seg)
	for g, h := range hs[:2] {
		if err := eng.WriteBytes(g, 2, dataplane.Identity{Hash: h, RequestID: "req"}, f.content(g, h)); err != nil {
			t.Fatal(err)
		}
	}
	items := []dataplane.PutItem{
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 2}, Key: f.prefix + "-0", Hash: hs[0]},
		{BlockRef: dataplane.BlockRef{Group: 1, Block: 2}, Key: f.prefix + "-1", Hash: hs[1]},
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 5}, Key: f.prefix + "-heap", Hash: hs[2]},
	}
	res, _, err := f.client.Put(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []dataplane.PutStatus{dataplane.PutStored, dataplane.PutStored, dataplane.PutNotHeld} {
		if res[i].Status != want {
			t.Fatalf("item %d: %+v, want %s", i, res[i], want)
		}
	}
	for g := range 2 {
		raw, err := f.rdb.Get(ctx, items[g].Key).Bytes()
		if err != nil {
			t.Fatal(err)
		}
		payload, err := dataplane.DecodeValue(f.model.Fingerprint(), raw)
		if err != nil || !bytes.Equal(payload, f.content(g, hs[g])) {
			t.Fatalf("group %d's stored value is not the engine's block: %v", g, err)
		}
	}
	if n, _ := f.rdb.Exists(ctx, items[2].Key).Result(); n != 0 {
		t.Fatal("a block of the replaced heap memory was stored")
	}
	got, err := f.client.Read(ctx, []dataplane.ReadRef{{BlockRef: items[0].BlockRef, Hash: hs[0]}})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].NotHeld != "" || !bytes.Equal(got[0].Data, f.content(0, hs[0])) || got[0].RequestID != "req" {
		t.Fatalf("read of the engine's block: not held %q or other bytes", got[0].NotHeld)
	}
	if _, err := eng.Evict(0, 2); err != nil {
		t.Fatal(err)
	}
	if got, err := f.client.Read(ctx, []dataplane.ReadRef{{BlockRef: items[0].BlockRef, Hash: hs[0]}}); err != nil || len(got) != 1 || got[0].NotHeld == "" {
		t.Fatalf("read after the engine evicted the block: %v, want a refusal", err)
	}
}

// rewriting is an engine memory whose engine rewrites one block right
// after the worker checked its record and before it copies the bytes out:
// the deterministic form of a block rewritten mid-read.
type rewriting struct {
	*kvmem.Segment
	group, block int
	rewrite      func()
}

// Regions hands out the block's regions, rewriting the target block first
// (once).
func (r *rewriting) Regions(group, block int) [][]byte {
	if group == r.group && block == r.block && r.rewrite != nil {
		rw := r.rewrite
		r.rewrite = nil
		rw()
	}
	return r.Segment.Regions(group, block)
}

// TestRewriteDuringPutNotStored: the engine rewrites a block between the
// put's record check and its send: the item is not_held and nothing is
// stored under its key, while the other item of the batch is.
func TestRewriteDuringPutNotStored(t *testing.T) {
	for _, route := range []string{"put", "read"} {
		t.Run(route, func(t *testing.T) {
			f := newMemFixture(t)
			ctx := context.Background()
			l := kvmem.ModelLayout(f.model, 8)
			seg := f.segment(t, l)
			eng := kvmem.NewEngineWriter(seg)
			h, other, next := hashOf("old"), hashOf("other"), hashOf("new")
			for b, hh := range map[int]string{1: h, 3: other} {
				if err := eng.WriteBytes(0, b, dataplane.Identity{Hash: hh}, f.content(0, hh)); err != nil {
					t.Fatal(err)
				}
			}
			rewrites := 0
			mem := &rewriting{Segment: seg, group: 0, block: 1, rewrite: func() {
				rewrites++
				if err := eng.WriteBytes(0, 1, dataplane.Identity{Hash: next}, f.content(0, next)); err != nil {
					t.Error(err)
				}
			}}
			if err := f.pool.Replace(mem); err != nil {
				t.Fatal(err)
			}
			refs := []dataplane.BlockRef{{Group: 0, Block: 1}, {Group: 0, Block: 3}}
			if route == "read" {
				got, err := f.client.Read(ctx, []dataplane.ReadRef{{BlockRef: refs[0], Hash: h}, {BlockRef: refs[1], Hash: other}})
				if err != nil || len(got) != 2 || got[0].NotHeld == "" || got[0].Data != nil || !bytes.Equal(got[1].Data, f.content(0, other)) {
					t.Fatalf("read: %v; want block 1 refused and block 3 served", err)
				}
			} else {
				items := []dataplane.PutItem{{BlockRef: refs[0], Key: f.prefix + "-1", Hash: h}, {BlockRef: refs[1], Key: f.prefix + "-3", Hash: other}}
				res, _, err := f.client.Put(ctx, items)
				if err != nil || res[0].Status != dataplane.PutNotHeld || res[1].Status != dataplane.PutStored {
					t.Fatalf("put: %+v, %v; want block 1 not_held and block 3 stored", res, err)
				}
				if n, _ := f.rdb.Exists(ctx, items[0].Key).Result(); n != 0 {
					t.Fatal("the rewritten block was stored")
				}
				if n, _ := f.rdb.Exists(ctx, items[1].Key).Result(); n != 1 {
					t.Fatal("the untouched block was not stored")
				}
			}
			if rewrites != 1 {
				t.Fatalf("the engine rewrote the block %d times, want once", rewrites)
			}
			if _, err := f.pool.Copy(0, 1, next); err != nil {
				t.Fatalf("the block's new content is not readable: %v", err)
			}
			var nh *pool.NotHeldError
			if _, err := f.pool.Copy(0, 1, h); !errors.As(err, &nh) {
				t.Fatalf("the old hash is still held: %v", err)
			}
		})
	}
}
