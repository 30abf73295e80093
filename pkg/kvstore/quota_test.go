package kvstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestQuotaPrimitives: on a single server and on a Redis Cluster (two
// namespaces, so their indexes may sit on different masters),
// CountStored counts each namespace's store-time index, OldestStored
// merges the indexes oldest first, IdleTimes gives present keys an idle
// time and a missing key -1, and RemoveForQuota removes the present keys
// (counting them) out of the store and their indexes and marks every one
// with its store time, each mark taken once by TakeQuotaMarks, while a
// key removed otherwise has no mark.
func TestQuotaPrimitives(t *testing.T) {
	urls := map[string]string{"single": testenv.RedisURL(t), "cluster": testenv.RedisCluster(t).URL()}
	for name, url := range urls {
		t.Run(name, func(t *testing.T) {
			r := newRedis(t, url, kvstore.RedisOptions{})
			ctx := context.Background()
			keys := testKeys(t, r, 6)
			for i := range keys { // namespaces a (0, 2, 4) and b (1, 3, 5)
				keys[i] = keys[i][:strings.LastIndexByte(keys[i], '@')] + "-ns" + string(rune('a'+i%2)) + "@h" + string(rune('a'+i))
			}
			cleanIndexes(t, r, keys)
			cleanQuotaMarks(t, r, keys)
			nsA, nsB := keys[0][:strings.LastIndexByte(keys[0], '@')], keys[1][:strings.LastIndexByte(keys[1], '@')]
			base := time.UnixMilli(1_800_000_000_000)
			for i, k := range keys[:5] {
				if err := r.MarkStored(ctx, []string{k}, base.Add(time.Duration(i)*time.Second)); err != nil {
					t.Fatal(err)
				}
			}
			items := make([]kvstore.Item, 4)
			for i := range items {
				items[i] = kvstore.Item{Key: keys[i], Value: []byte("v")}
			}
			if _, err := r.Put(ctx, items); err != nil {
				t.Fatal(err)
			}

			counts, err := r.CountStored(ctx, []string{nsA, nsB, nsA + "-none"})
			if err != nil || counts[0] != 3 || counts[1] != 2 || counts[2] != 0 {
				t.Fatalf("CountStored = %v, %v; want [3 2 0]", counts, err)
			}
			oldest, err := r.OldestStored(ctx, []string{nsA, nsB}, 4)
			if err != nil || len(oldest) != 4 {
				t.Fatalf("OldestStored = %v, %v; want 4 keys", oldest, err)
			}
			for i, sk := range oldest {
				if sk.Key != keys[i] || !sk.StoredAt.Equal(base.Add(time.Duration(i)*time.Second)) {
					t.Errorf("oldest[%d] = %s at %v, want %s at %v", i, sk.Key, sk.StoredAt, keys[i], base.Add(time.Duration(i)*time.Second))
				}
			}
			idle, err := r.IdleTimes(ctx, []string{keys[0], keys[4]})
			if err != nil || idle[0] < 0 || idle[1] != -1 {
				t.Fatalf("IdleTimes = %v, %v; want a present key's time and -1 for a missing one", idle, err)
			}

			removed, err := r.RemoveForQuota(ctx, oldest[:2], base.Add(time.Hour))
			if err != nil || removed != 2 {
				t.Fatalf("RemoveForQuota = %d, %v; want 2", removed, err)
			}
			if counts, err := r.CountStored(ctx, []string{nsA, nsB}); err != nil || counts[0] != 2 || counts[1] != 1 {
				t.Fatalf("after RemoveForQuota CountStored = %v, %v; want [2 1]: the removed keys leave their indexes", counts, err)
			}
			if found, err := r.Exists(ctx, keys[:3]); err != nil || found[0] || found[1] || !found[2] {
				t.Fatalf("after RemoveForQuota Exists = %v, %v; want [false false true]", found, err)
			}
			if _, err := r.Remove(ctx, keys[2:3]); err != nil { // an operator's delete: no mark
				t.Fatal(err)
			}
			marks, err := r.TakeQuotaMarks(ctx, keys[:3])
			if err != nil || !marks[0].Equal(base) || !marks[1].Equal(base.Add(time.Second)) || !marks[2].IsZero() {
				t.Fatalf("TakeQuotaMarks = %v, %v; want the first two keys' store times and the zero time", marks, err)
			}
			if again, err := r.TakeQuotaMarks(ctx, keys[:2]); err != nil || !again[0].IsZero() || !again[1].IsZero() {
				t.Fatalf("marks taken twice: %v, %v; want none", again, err)
			}
			if n, err := r.RemoveForQuota(ctx, []kvstore.StoredKey{{Key: "no-namespace"}}, base); err == nil || n != 0 {
				t.Fatalf("RemoveForQuota of a string with no namespace: %d, %v; want an error", n, err)
			}
		})
	}
}

// cleanQuotaMarks removes the quota marks of keys' namespaces when the
// test ends.
func cleanQuotaMarks(t *testing.T, s kvstore.Store, keys []string) {
	t.Helper()
	var idx []string
	for _, k := range keys {
		idx = append(idx, k[:strings.LastIndexByte(k, '@')]+kvstore.QuotaIndexSuffix)
	}
	t.Cleanup(func() { _, _ = s.Remove(context.Background(), idx) })
}
