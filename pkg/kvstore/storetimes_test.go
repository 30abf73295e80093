package kvstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestStoreTimes: on a single server and on a Redis Cluster (keys of many
// namespaces, so their indexes sit on several masters), MarkStored keeps
// a key's first store time, TakeStored returns it once and then the zero
// time, a key never marked has the zero time, and a string without a
// namespace is refused by MarkStored and has the zero time in TakeStored.
func TestStoreTimes(t *testing.T) {
	urls := map[string]string{"single": testenv.RedisURL(t), "cluster": testenv.RedisCluster(t).URL()}
	for name, url := range urls {
		t.Run(name, func(t *testing.T) {
			r := newRedis(t, url, kvstore.RedisOptions{})
			ctx := context.Background()
			keys := testKeys(t, r, 12)
			for i := range keys { // 4 namespaces of 3 keys
				keys[i] = keys[i][:strings.LastIndexByte(keys[i], '@')] + "-ns" + string(rune('a'+i%4)) + "@h" + string(rune('a'+i))
			}
			cleanIndexes(t, r, keys)
			first, later := time.UnixMilli(1_800_000_000_123), time.UnixMilli(1_800_000_100_000)
			if err := r.MarkStored(ctx, keys[:8], first); err != nil {
				t.Fatal(err)
			}
			if err := r.MarkStored(ctx, keys[:10], later); err != nil { // 0..7 keep their first time
				t.Fatal(err)
			}
			got, err := r.TakeStored(ctx, keys)
			if err != nil {
				t.Fatal(err)
			}
			for i, at := range got {
				want := time.Time{}
				switch {
				case i < 8:
					want = first
				case i < 10:
					want = later
				}
				if !at.Equal(want) {
					t.Errorf("key %d stored at %v, want %v", i, at, want)
				}
			}
			// A mark drops the times past the horizon from the indexes it writes.
			if err := r.MarkStored(ctx, keys[:1], first); err != nil {
				t.Fatal(err)
			}
			if err := r.MarkStored(ctx, keys[4:5], first.Add(kvstore.StoreTimesHorizon+time.Second)); err != nil { // keys 0, 4 and 8 share a namespace
				t.Fatal(err)
			}
			if got, err := r.TakeStored(ctx, keys[:1]); err != nil || !got[0].IsZero() {
				t.Fatalf("a time past the horizon: %v, %v; want it dropped", got, err)
			}
			if got, err := r.TakeStored(ctx, keys[4:5]); err != nil || got[0].IsZero() {
				t.Fatalf("the new time: %v, %v", got, err)
			}
			again, err := r.TakeStored(ctx, keys[:3])
			if err != nil || !again[0].IsZero() || !again[2].IsZero() {
				t.Fatalf("taken twice: %v, %v; want zero times", again, err)
			}
			if err := r.MarkStored(ctx, []string{"no-namespace"}, first); err == nil {
				t.Fatal("MarkStored of a string with no namespace: nil error")
			}
			if got, err := r.TakeStored(ctx, []string{"no-namespace"}); err != nil || !got[0].IsZero() {
				t.Fatalf("TakeStored of a string with no namespace: %v, %v", got, err)
			}
		})
	}
}

// cleanIndexes removes the store-time indexes of keys' namespaces when the
// test ends.
func cleanIndexes(t *testing.T, s kvstore.Store, keys []string) {
	t.Helper()
	var idx []string
	for _, k := range keys {
		idx = append(idx, k[:strings.LastIndexByte(k, '@')]+kvstore.StoredIndexSuffix)
	}
	t.Cleanup(func() { _, _ = s.Remove(context.Background(), idx) })
}
