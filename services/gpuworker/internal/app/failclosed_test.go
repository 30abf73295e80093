package app_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// These tests pin the data plane's fail-closed rule: a pool block is served
// (read, put, pd source) only while it holds exactly the chunk hash asked.

// ref is block b of group g.
func ref(g int, b kvcore.BlockID) dataplane.BlockRef { return dataplane.BlockRef{Group: g, Block: b} }

// readRef asks for block b of group g holding hash.
func readRef(g int, b kvcore.BlockID, hash string) dataplane.ReadRef {
	return dataplane.ReadRef{BlockRef: ref(g, b), Hash: hash}
}

// write writes one block as hash, written by request req, and returns its bytes.
func (w *worker) write(t *testing.T, g int, b kvcore.BlockID, hash, req string) []byte {
	t.Helper()
	data := w.randomBlock(g)
	if err := w.client.Write(context.Background(), []dataplane.Block{
		{BlockRef: ref(g, b), Identity: dataplane.Identity{Hash: hash, RequestID: req}, Data: data},
	}); err != nil {
		t.Fatal(err)
	}
	return data
}

// TestReadRefusesBlocksNotHeld reads, in one request, blocks that hold the
// asked hash and blocks that do not: the refused ones come back NotHeld
// with what they hold instead and no data, the others are served with
// their bytes, and each refusal is counted.
func TestReadRefusesBlocksNotHeld(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-notheld-read"), nil)
	ctx := context.Background()
	ha, hb, hc, hd, hx := randomHex(32), randomHex(32), randomHex(32), randomHex(32), randomHex(32)
	a := w.write(t, 0, 1, ha, "req-a")
	w.write(t, 1, 2, hb, "req-b")
	b := w.write(t, 1, 2, hb, "req-b2") // the same chunk rewritten by another request: still served
	w.write(t, 0, 3, hc, "req-c")
	d := w.write(t, 0, 3, hd, "req-d") // reused for another chunk
	w.write(t, 0, 4, hx, "req-x")
	if n, err := w.client.Evict(ctx, []dataplane.BlockRef{ref(0, 4)}); err != nil || n != 1 {
		t.Fatalf("Evict = %d, %v", n, err)
	}
	tests := []struct {
		name   string
		ref    dataplane.ReadRef
		data   []byte   // served bytes; nil: refused
		reason []string // what a refusal's reason names
	}{
		{"held", readRef(0, 1, ha), a, nil},
		{"asked with another hash", readRef(1, 2, hx), nil, []string{hb, "req-b2"}},
		{"never written", readRef(0, 5, ha), nil, []string{"holds nothing"}},
		{"rewritten for another chunk", readRef(0, 3, hc), nil, []string{hd, "req-d"}},
		{"the rewrite's chunk", readRef(0, 3, hd), d, nil},
		{"evicted", readRef(0, 4, hx), nil, []string{"holds nothing"}},
		{"same chunk rewritten by another request", readRef(1, 2, hb), b, nil},
	}
	refs := make([]dataplane.ReadRef, len(tests))
	for i, tc := range tests {
		refs[i] = tc.ref
	}
	got, err := w.client.Read(ctx, refs)
	if err != nil {
		t.Fatal(err)
	}
	refused := 0
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := got[i]
			if g.BlockRef != tc.ref.BlockRef {
				t.Fatalf("block %+v, asked %+v", g.BlockRef, tc.ref.BlockRef)
			}
			if tc.data != nil {
				if g.NotHeld != "" || g.Hash != tc.ref.Hash || !bytes.Equal(g.Data, tc.data) {
					t.Fatalf("want served: NotHeld %q, hash %s, %d bytes (equal %v)", g.NotHeld, g.Hash, len(g.Data), bytes.Equal(g.Data, tc.data))
				}
				return
			}
			if g.NotHeld == "" || g.Data != nil {
				t.Fatalf("want refused: NotHeld %q with %d bytes", g.NotHeld, len(g.Data))
			}
			for _, s := range append(tc.reason, tc.ref.Hash) {
				if !strings.Contains(g.NotHeld, s) {
					t.Fatalf("reason %q lacks %q", g.NotHeld, s)
				}
			}
		})
		if tc.data == nil {
			refused++
		}
	}
	if got[6].RequestID != "req-b2" {
		t.Fatalf("the rewritten block reports request %q, want req-b2", got[6].RequestID)
	}
	waitMetric(t, w, fmt.Sprintf(`kvmesh_gpuworker_not_held_total{op="read"} %d`, refused))
}

// TestPutStoresOnlyHeldBlocks puts, in one request, items whose blocks hold
// their hash and items whose blocks do not: the refused ones are not_held
// and nothing is stored under their keys, the others are stored, byte
// exact, and each refusal is counted.
func TestPutStoresOnlyHeldBlocks(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-notheld-put"), nil)
	ctx := context.Background()
	hashes := hexChain(w.model, tokens(16*8, 900))
	other := randomHex(32)
	held0 := w.write(t, 0, 1, hashes[0], "req-1")
	held1 := w.write(t, 1, 2, hashes[1], "req-1")
	w.write(t, 0, 3, hashes[2], "req-1")
	w.write(t, 0, 3, other, "req-2") // reused by another request for another chunk
	w.write(t, 0, 4, hashes[3], "req-1")
	if _, err := w.client.Evict(ctx, []dataplane.BlockRef{ref(0, 4)}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		item dataplane.PutItem
		want dataplane.PutStatus
		data []byte // stored payload
	}{
		{"held", dataplane.PutItem{BlockRef: ref(0, 1), Hash: hashes[0]}, dataplane.PutStored, held0},
		{"rewritten for another chunk", dataplane.PutItem{BlockRef: ref(0, 3), Hash: hashes[2]}, dataplane.PutNotHeld, nil},
		{"evicted", dataplane.PutItem{BlockRef: ref(0, 4), Hash: hashes[3]}, dataplane.PutNotHeld, nil},
		{"never written", dataplane.PutItem{BlockRef: ref(0, 5), Hash: hashes[4]}, dataplane.PutNotHeld, nil},
		{"no hash", dataplane.PutItem{BlockRef: ref(0, 1)}, dataplane.PutNotHeld, nil},
		{"held, other group", dataplane.PutItem{BlockRef: ref(1, 2), Hash: hashes[1]}, dataplane.PutStored, held1},
	}
	items := make([]dataplane.PutItem, len(tests))
	for i, tc := range tests {
		items[i] = tc.item
		items[i].RequestID = "req-save"
		items[i].Key = w.keys.KeyHex(kvcore.Rank{}, tc.item.Group, hashes[i]) // distinct per item
	}
	res, n, err := w.client.Put(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	fp := w.model.Fingerprint()
	rdb := redisClient(t, env.RedisURL)
	var wantBytes int64
	refused := 0
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if res[i].Status != tc.want {
				t.Fatalf("result %+v, want %s", res[i], tc.want)
			}
			raw, err := rdb.Get(ctx, items[i].Key).Bytes()
			if tc.data == nil {
				if err == nil || !strings.Contains(res[i].Error, "hash") {
					t.Fatalf("refused item: key stored (%d bytes), error %q", len(raw), res[i].Error)
				}
				return
			}
			if err != nil {
				t.Fatalf("key %s: %v", items[i].Key, err)
			}
			if payload, err := dataplane.DecodeValue(fp, raw); err != nil || !bytes.Equal(payload, tc.data) {
				t.Fatalf("stored value does not decode to the block's bytes: %v", err)
			}
		})
		if tc.data != nil {
			wantBytes += int64(len(tc.data) + dataplane.ValueOverhead(len(fp)))
		} else {
			refused++
		}
	}
	if n != wantBytes {
		t.Fatalf("bytes = %d, want %d", n, wantBytes)
	}
	waitMetric(t, w, fmt.Sprintf(`kvmesh_gpuworker_not_held_total{op="put"} %d`, refused))
	waitMetric(t, w, `kvmesh_store_keys_total{op="save_put"} 2`)
}

// TestEvictThenWriteAgain evicts blocks: the count says which held
// something, the pool stops counting them in use, reads and puts of them
// are refused until they are written again, and the rest are untouched.
func TestEvictThenWriteAgain(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-evict"), nil)
	ctx := context.Background()
	h1, h2 := randomHex(32), randomHex(32)
	w.write(t, 0, 1, h1, "req-1")
	kept := w.write(t, 0, 2, h2, "req-1")
	var pool app.PoolAnswer
	getJSON(t, "http://"+w.addr+"/v1/pool", &pool)
	if pool.Groups[0].InUse != 2 {
		t.Fatalf("in use before eviction = %d", pool.Groups[0].InUse)
	}
	if n, err := w.client.Evict(ctx, []dataplane.BlockRef{ref(0, 1), ref(0, 7)}); err != nil || n != 1 {
		t.Fatalf("Evict = %d, %v; want 1 (block 7 held nothing)", n, err)
	}
	getJSON(t, "http://"+w.addr+"/v1/pool", &pool)
	if pool.Groups[0].InUse != 1 {
		t.Fatalf("in use after eviction = %d, want 1", pool.Groups[0].InUse)
	}
	key := w.keys.KeyHex(kvcore.Rank{}, 0, h1)
	res, _, err := w.client.Put(ctx, []dataplane.PutItem{{BlockRef: ref(0, 1), Key: key, Hash: h1}})
	if err != nil || res[0].Status != dataplane.PutNotHeld {
		t.Fatalf("put of an evicted block = %+v, %v; want not_held", res, err)
	}
	rdb := redisClient(t, env.RedisURL)
	if n, _ := rdb.Exists(ctx, key).Result(); n != 0 {
		t.Fatal("an evicted block was stored")
	}
	got, err := w.client.Read(ctx, []dataplane.ReadRef{readRef(0, 1, h1), readRef(0, 2, h2)})
	if err != nil || got[0].NotHeld == "" || got[1].NotHeld != "" || !bytes.Equal(got[1].Data, kept) {
		t.Fatalf("read after eviction = %+v, %v", got, err)
	}
	again := w.write(t, 0, 1, h1, "req-2")
	res, _, err = w.client.Put(ctx, []dataplane.PutItem{{BlockRef: ref(0, 1), Key: key, Hash: h1}})
	if err != nil || res[0].Status != dataplane.PutStored {
		t.Fatalf("put of the rewritten block = %+v, %v", res, err)
	}
	raw, err := rdb.Get(ctx, key).Bytes()
	if err != nil {
		t.Fatal(err)
	}
	if payload, err := dataplane.DecodeValue(w.model.Fingerprint(), raw); err != nil || !bytes.Equal(payload, again) {
		t.Fatalf("stored value is not the rewrite's bytes: %v", err)
	}
}

// TestWriteRejectsFramesWithoutIdentity sends raw write bodies the client
// would refuse to build: a frame without a hash and a frame flagged not
// held are rejected with 400 and leave their block holding nothing.
func TestWriteRejectsFramesWithoutIdentity(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-noid"), nil)
	data := w.randomBlock(0)
	tests := []struct {
		name string
		h    dataplane.FrameHeader
	}{
		{"no hash", dataplane.FrameHeader{Group: 0, Block: 6, Len: len(data), Checksum: dataplane.Checksum(data)}},
		{"flagged not held", dataplane.FrameHeader{Group: 0, Block: 6, Len: len(data), Checksum: dataplane.Checksum(data),
			NotHeld: true, Identity: dataplane.Identity{Hash: "ab"}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			body := append(dataplane.AppendFrameHeader(nil, tc.h), data...)
			resp, err := http.Post("http://"+w.addr+dataplane.PathWrite, dataplane.ContentTypeFrames, bytes.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				t.Fatalf("status %s, want 400", resp.Status)
			}
			got, err := w.client.Read(context.Background(), []dataplane.ReadRef{readRef(0, 6, "ab")})
			if err != nil || got[0].NotHeld == "" {
				t.Fatalf("the block holds something: %+v, %v", got, err)
			}
		})
	}
}

// TestRestartedWorkerRefusesBlocksTheOldOneHeld runs a gpuworker process,
// writes blocks and saves one, SIGKILLs it and starts another on the same
// Redis and engine: the new worker's pool holds nothing, so every read and
// put of the old blocks is refused and nothing more is stored.
func TestRestartedWorkerRefusesBlocksTheOldOneHeld(t *testing.T) {
	t.Parallel()
	bin := testenv.BuildBinary(t, "./services/gpuworker")
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-restarted")
	vars := processVars(env, cfg, env.RedisURL)
	first := runWorker(t, bin, vars)
	w := first.view(t, cfg)
	ctx := context.Background()
	hashes := hexChain(w.model, tokens(48, 950))
	w.write(t, 0, 1, hashes[0], "req-1")
	w.write(t, 0, 2, hashes[1], "req-1")
	w.write(t, 1, 3, hashes[2], "req-1")
	key := func(g, i int) string { return w.keys.KeyHex(kvcore.Rank{}, g, hashes[i]) }
	res, _, err := w.client.Put(ctx, []dataplane.PutItem{{BlockRef: ref(0, 1), Key: key(0, 0), Hash: hashes[0]}})
	if err != nil || res[0].Status != dataplane.PutStored {
		t.Fatalf("put on the first worker = %+v, %v", res, err)
	}
	first.kill()

	second := runWorker(t, bin, vars)
	w.client, w.addr = dataplane.NewClient("http://"+second.addr, nil), second.addr
	refs := []dataplane.ReadRef{readRef(0, 1, hashes[0]), readRef(0, 2, hashes[1]), readRef(1, 3, hashes[2])}
	got, err := w.client.Read(ctx, refs)
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range got {
		if b.NotHeld == "" || b.Data != nil || !strings.Contains(b.NotHeld, "holds nothing") {
			t.Fatalf("block %d after the restart: %+v", i, b)
		}
	}
	items := []dataplane.PutItem{
		{BlockRef: ref(0, 2), Key: key(0, 1), Hash: hashes[1]},
		{BlockRef: ref(1, 3), Key: key(1, 2), Hash: hashes[2]},
	}
	res, n, err := w.client.Put(ctx, items)
	if err != nil || n != 0 {
		t.Fatalf("put on the restarted worker: %d bytes, %v", n, err)
	}
	rdb := redisClient(t, env.RedisURL)
	for i, r := range res {
		if r.Status != dataplane.PutNotHeld {
			t.Fatalf("item %d = %+v, want not_held", i, r)
		}
		if n, _ := rdb.Exists(ctx, items[i].Key).Result(); n != 0 {
			t.Fatalf("item %d was stored by the restarted worker", i)
		}
	}
	if n, _ := rdb.Exists(ctx, key(0, 0)).Result(); n != 1 {
		t.Fatal("the first worker's save is gone")
	}
	waitMetric(t, w, `kvmesh_gpuworker_not_held_total{op="read"} 3`)
	waitMetric(t, w, `kvmesh_gpuworker_not_held_total{op="put"} 2`)
}

// TestPDLoadOfSourceBlocksNotHeld loads from a prefill worker whose source
// blocks were evicted or reused for another request's chunk before the
// decode worker read them: those blocks are load errors and keep their
// previous content, the others are loaded byte exact, and both workers
// count the refusals.
func TestPDLoadOfSourceBlocksNotHeld(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	prefill := startWorker(t, testConfig(env, "engine-pd-src"), nil)
	decode := startWorker(t, testConfig(env, "engine-pd-dst"), nil)
	rs := watchResults(t, env)
	waitRegistered(t, env, "engine-pd-src")

	hashes := hexChain(decode.model, tokens(48, 1000))
	src := prefill.fillAs(t, 0, []kvcore.BlockID{10, 11, 12}, hashes)
	src[13] = prefill.fillAs(t, 1, []kvcore.BlockID{13}, hashes[2:])[13]
	if n, err := prefill.client.Evict(context.Background(), []dataplane.BlockRef{ref(0, 11)}); err != nil || n != 1 {
		t.Fatalf("Evict = %d, %v", n, err)
	}
	prefill.write(t, 0, 12, randomHex(32), "req-other") // preempted: the block now holds another request's chunk
	prev := decode.fill(t, 0, 2, 3)

	task := decode.loadTask(hashes, 48, kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 4}})
	task.Connector = "pd"
	task.Remote = &kvcore.RemoteSource{EngineID: "engine-pd-src", BlockTable: kvcore.BlockTable{{10, 11, 12}, {kvcore.NullBlock, kvcore.NullBlock, 13}}}
	publishTask(t, publisher(t, env), task)

	g0, g1 := decode.model.Groups[0].BytesPerBlock, decode.model.Groups[1].BytesPerBlock
	assertLoadResult(t, rs.wait(t, task.TaskID), decode, task, []kvcore.BlockID{2, 3}, g0+g1)
	decode.assertBlock(t, 0, 1, hashes[0], src[10].Data, "not the prefill worker's block")
	decode.assertBlock(t, 1, 4, hashes[2], src[13].Data, "not the prefill worker's block")
	decode.assertBlock(t, 0, 2, prev[2].Hash, prev[2].Data, "an evicted source changed the block")
	decode.assertBlock(t, 0, 3, prev[3].Hash, prev[3].Data, "a reused source changed the block")
	got, err := decode.client.Read(context.Background(), []dataplane.ReadRef{readRef(0, 3, hashes[2])})
	if err != nil || got[0].NotHeld == "" {
		t.Fatalf("the failed block holds the chunk: %+v, %v", got, err)
	}
	waitMetric(t, decode, `kvmesh_gpuworker_not_held_total{op="pd_source"} 2`)
	waitMetric(t, prefill, `kvmesh_gpuworker_not_held_total{op="read"} 2`)
}
