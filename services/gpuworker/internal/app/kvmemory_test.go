package app_test

import (
	"bytes"
	"context"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
)

// TestEngineMemoryPutThroughWorker: an engine registers a shared segment
// with a running gpuworker, writes blocks straight into it, and the
// worker's put route stores them byte-exact in Redis; /v1/pool counts them
// in use.
func TestEngineMemoryPutThroughWorker(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-kvmem"), nil)
	ctx := context.Background()
	base := "http://" + w.addr
	l := kvmem.ModelLayout(w.model, 16)
	seg, err := kvmem.Create(filepath.Join(t.TempDir(), "engine.kvmem"), l)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Remove()
	if cur, err := kvmem.Current(ctx, http.DefaultClient, base); err != nil || cur.Kind != kvmem.KindHeap {
		t.Fatalf("before registration: %+v, %v", cur, err)
	}
	if _, err := kvmem.Register(ctx, http.DefaultClient, base, kvmem.Registration{Kind: kvmem.KindShm, Path: seg.Path(), Layout: l}); err != nil {
		t.Fatal(err)
	}
	eng := kvmem.NewEngineWriter(seg)
	hashes := hexChain(w.model, tokens(32, 11))
	data := [][]byte{w.randomBlock(0), w.randomBlock(1)}
	items := make([]dataplane.PutItem, 2)
	for g := range 2 {
		if err := eng.WriteBytes(g, 7, dataplane.Identity{Hash: hashes[g], RequestID: "r"}, data[g]); err != nil {
			t.Fatal(err)
		}
		items[g] = dataplane.PutItem{BlockRef: dataplane.BlockRef{Group: g, Block: 7}, Key: w.keys.KeyHex(kvcore.Rank{}, g, hashes[g]), Hash: hashes[g]}
	}
	res, _, err := w.client.Put(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redisClient(t, env.RedisURL)
	for g, r := range res {
		if r.Status != dataplane.PutStored {
			t.Fatalf("item %d: %+v", g, r)
		}
		raw, err := rdb.Get(ctx, items[g].Key).Bytes()
		if err != nil {
			t.Fatal(err)
		}
		if payload, err := dataplane.DecodeValue(w.model.Fingerprint(), raw); err != nil || !bytes.Equal(payload, data[g]) {
			t.Fatalf("group %d: the stored value is not the engine's block: %v", g, err)
		}
	}
	var pool struct {
		Groups []struct {
			InUse int `json:"in_use"`
		} `json:"groups"`
	}
	getJSON(t, base+"/v1/pool", &pool)
	if len(pool.Groups) != 2 || pool.Groups[0].InUse != 1 || pool.Groups[1].InUse != 1 {
		t.Fatalf("pool after the engine's writes: %+v", pool)
	}
}
