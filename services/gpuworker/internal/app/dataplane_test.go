package app_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

func TestClientWriteReadByteExact(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-rw"), nil)
	w.client.WriteBatchBytes = 300 << 10 // force several write requests
	ctx := context.Background()

	var blocks []dataplane.Block
	for b := range 6 {
		for g := range w.model.Groups {
			blocks = append(blocks, dataplane.Block{BlockRef: dataplane.BlockRef{Group: g, Block: kvcore.BlockID(b * 2)},
				Identity: dataplane.Identity{Hash: randomHex(32), RequestID: "req-rw"}, Data: w.randomBlock(g)})
		}
	}
	if err := w.client.Write(ctx, blocks); err != nil {
		t.Fatal(err)
	}
	refs := make([]dataplane.ReadRef, len(blocks))
	for i := range blocks {
		refs[len(refs)-1-i] = dataplane.ReadRef{BlockRef: blocks[i].BlockRef, Hash: blocks[i].Hash} // read back in reverse order
	}
	got, err := w.client.Read(ctx, refs)
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range got {
		want := blocks[len(blocks)-1-i]
		if b.NotHeld != "" || b.BlockRef != want.BlockRef || b.Identity != want.Identity || b.Generation == 0 || !bytes.Equal(b.Data, want.Data) {
			t.Fatalf("read %d: %+v %+v gen %d %q (%d bytes) differs from what was written to %+v", i, b.BlockRef, b.Identity, b.Generation, b.NotHeld, len(b.Data), want.BlockRef)
		}
	}
	if got, err := w.client.Read(ctx, nil); err != nil || len(got) != 0 {
		t.Fatalf("empty Read = %v, %v", got, err)
	}
}

func TestClientRejectsInvalidRequests(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-bad"), nil)
	ctx := context.Background()
	bpb := int(w.model.Groups[0].BytesPerBlock)
	id := dataplane.Identity{Hash: randomHex(32)}
	tests := []struct {
		name string
		call func() error
		want error
	}{
		{"write of a short block", func() error {
			return w.client.Write(ctx, []dataplane.Block{{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}, Identity: id, Data: make([]byte, bpb-1)}})
		}, dataplane.ErrRejected},
		{"write past the pool", func() error {
			return w.client.Write(ctx, []dataplane.Block{{BlockRef: dataplane.BlockRef{Group: 0, Block: 16}, Identity: id, Data: make([]byte, bpb)}})
		}, dataplane.ErrRejected},
		{"write to a group the model lacks", func() error {
			return w.client.Write(ctx, []dataplane.Block{{BlockRef: dataplane.BlockRef{Group: 2, Block: 0}, Identity: id, Data: make([]byte, bpb)}})
		}, dataplane.ErrRejected},
		{"read of a null block", func() error {
			_, err := w.client.Read(ctx, []dataplane.ReadRef{{BlockRef: dataplane.BlockRef{Group: 0, Block: kvcore.NullBlock}, Hash: id.Hash}})
			return err
		}, dataplane.ErrRejected},
		{"read without a hash", func() error {
			_, err := w.client.Read(ctx, []dataplane.ReadRef{{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}}})
			return err
		}, dataplane.ErrRejected},
		{"write without a hash (refused by the client)", func() error {
			return w.client.Write(ctx, []dataplane.Block{{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}, Data: make([]byte, bpb)}})
		}, dataplane.ErrIdentity},
		{"evict past the pool", func() error {
			_, err := w.client.Evict(ctx, []dataplane.BlockRef{{Group: 0, Block: 1}, {Group: 0, Block: 16}})
			return err
		}, dataplane.ErrRejected},
		{"worker unreachable", func() error {
			_, err := dataplane.NewClient("http://127.0.0.1:1", nil).Read(ctx, []dataplane.ReadRef{{BlockRef: dataplane.BlockRef{Group: 0, Block: 0}, Hash: id.Hash}})
			return err
		}, dataplane.ErrUnavailable},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(); !errors.Is(err, tc.want) {
				t.Fatalf("error = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestClientPutStoresFramedValues(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-put"), nil)
	ctx := context.Background()
	data := [][]byte{w.randomBlock(0), w.randomBlock(1)}
	hashes := hexChain(w.model, tokens(32, 7))
	if err := w.client.Write(ctx, []dataplane.Block{
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 3}, Identity: dataplane.Identity{Hash: hashes[0]}, Data: data[0]},
		{BlockRef: dataplane.BlockRef{Group: 1, Block: 4}, Identity: dataplane.Identity{Hash: hashes[1]}, Data: data[1]},
	}); err != nil {
		t.Fatal(err)
	}
	items := []dataplane.PutItem{
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 3}, Key: w.keys.KeyHex(kvcore.Rank{}, 0, hashes[0]), Hash: hashes[0]},
		{BlockRef: dataplane.BlockRef{Group: 1, Block: 4}, Key: w.keys.KeyHex(kvcore.Rank{}, 1, hashes[1]), Hash: hashes[1]},
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 99}, Key: w.keys.KeyHex(kvcore.Rank{}, 0, hashes[1]), Hash: hashes[1]},
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 3}, Key: "", Hash: hashes[0]},
	}
	res, n, err := w.client.Put(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	wantStatus := []dataplane.PutStatus{dataplane.PutStored, dataplane.PutStored, dataplane.PutFailed, dataplane.PutFailed}
	for i, r := range res {
		if r.Status != wantStatus[i] {
			t.Fatalf("result %d = %+v, want %s", i, r, wantStatus[i])
		}
	}
	fp := w.model.Fingerprint()
	if want := int64(len(data[0]) + len(data[1]) + 2*dataplane.ValueOverhead(len(fp))); n != want {
		t.Fatalf("bytes = %d, want %d", n, want)
	}
	rdb := redisClient(t, env.RedisURL)
	for i := range 2 {
		raw, err := rdb.Get(ctx, items[i].Key).Bytes()
		if err != nil {
			t.Fatalf("key %s: %v", items[i].Key, err)
		}
		payload, err := dataplane.DecodeValue(fp, raw)
		if err != nil || !bytes.Equal(payload, data[i]) {
			t.Fatalf("stored value %d does not decode to the block: %v", i, err)
		}
	}
	if n, _ := rdb.Exists(ctx, items[2].Key).Result(); n != 0 {
		t.Fatal("an item with an invalid block was stored")
	}
	// Each stored key's time is in its namespace's index (the removal
	// watcher reads it to say the block's age); the refused one's is not.
	for i, stored := range []bool{true, true, false} {
		ns, hash, _ := kvcore.SplitKey(items[i].Key)
		at, err := rdb.ZScore(ctx, ns+kvstore.StoredIndexSuffix, hash).Result()
		if !stored {
			if err == nil {
				t.Errorf("item %d was refused but has a store time", i)
			}
			continue
		}
		if err != nil || time.Since(time.UnixMilli(int64(at*1e3))).Abs() > time.Minute {
			t.Errorf("item %d: store time %v (%v), want about now", i, at, err)
		}
	}
	m := metricsText(t, w)
	for _, want := range []string{
		fmt.Sprintf(`kvmesh_store_bytes_total{op="save_put"} %d`, n),
		`kvmesh_store_keys_total{op="save_put"} 2`,
		`kvmesh_store_op_duration_seconds_count{op="save_put"} 1`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestClientPutReportsNoSpace(t *testing.T) {
	t.Parallel()
	tiny := testenv.StartRedis(t, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-full")
	cfg.RedisURL = tiny.URL()
	cfg.PoolBlocks = 24
	cfg.StoreStreams = 1 // sub-batches in order: the first items get the space
	w := startWorker(t, cfg, nil)
	ctx := context.Background()
	hashes := hexChain(w.model, tokens(24*16, 1))
	var blocks []dataplane.Block
	var items []dataplane.PutItem
	for b := range 24 { // 24 × 256 KiB: far over 3 MB
		ref := dataplane.BlockRef{Group: 1, Block: kvcore.BlockID(b)}
		blocks = append(blocks, dataplane.Block{BlockRef: ref, Identity: dataplane.Identity{Hash: hashes[b]}, Data: w.randomBlock(1)})
		items = append(items, dataplane.PutItem{BlockRef: ref, Key: w.keys.KeyHex(kvcore.Rank{}, 1, hashes[b]), Hash: hashes[b]})
	}
	if err := w.client.Write(ctx, blocks); err != nil {
		t.Fatal(err)
	}
	res, n, err := w.client.Put(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	stored, full := 0, 0
	for _, r := range res {
		switch r.Status {
		case dataplane.PutStored:
			stored++
		case dataplane.PutNoSpace:
			full++
		default:
			t.Fatalf("unexpected result %+v", r)
		}
	}
	if res[0].Status != dataplane.PutStored || res[len(res)-1].Status != dataplane.PutNoSpace || full == 0 {
		t.Fatalf("statuses %+v: want the first stored and the last no_space", res)
	}
	if want := int64(stored) * int64(len(blocks[0].Data)+dataplane.ValueOverhead(len(w.model.Fingerprint()))); n != want {
		t.Fatalf("bytes = %d, want %d for %d stored values", n, want, stored)
	}
	waitMetric(t, w, fmt.Sprintf(`kvmesh_store_failed_keys_total{op="save_put",status="no_space"} %d`, full))
	rdb := redisClient(t, tiny.URL())
	for i, r := range res {
		exists, _ := rdb.Exists(ctx, items[i].Key).Result()
		if (exists == 1) != (r.Status == dataplane.PutStored) {
			t.Fatalf("item %d: status %s but exists=%d", i, r.Status, exists)
		}
	}
}
