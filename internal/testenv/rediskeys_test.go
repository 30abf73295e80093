package testenv_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

func TestKeyPrefixIsFresh(t *testing.T) {
	a, b := testenv.KeyPrefix("t"), testenv.KeyPrefix("t")
	if a == b || len(a) != len("t")+8 || !strings.HasPrefix(a, "t") {
		t.Fatalf("KeyPrefix gave %q and %q; want t + 8 hex digits, different each time", a, b)
	}
}

func TestEachKeyBatchAndDropKeys(t *testing.T) {
	redisURL := testenv.RedisURL(t)
	o, err := redis.ParseURL(redisURL)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(o)
	t.Cleanup(func() { _ = c.Close() }) // last: the cleanups below use c
	ctx := t.Context()
	prefix, other := testenv.KeyPrefix("keys"), testenv.KeyPrefix("keys")
	t.Cleanup(func() { testenv.DropKeys(t, redisURL, other) })
	var mine []string
	pairs := []any{other + "@x", "kept", prefix + "-not-under@x", "kept"} // another prefix; no @ after prefix
	for i := range 1500 {                                                 // two batches
		k := fmt.Sprintf("%s@block-%d", prefix, i)
		mine = append(mine, k)
		pairs = append(pairs, k, "v")
	}
	if err := c.MSet(ctx, pairs...).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Del(context.Background(), prefix+"-not-under@x").Err(); err != nil {
			t.Error(err)
		}
	})

	var seen []string
	batches := 0
	err = testenv.EachKeyBatch(redisURL, prefix, func(_ context.Context, _ *redis.Client, keys []string) error {
		batches++
		seen = append(seen, keys...)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(seen)
	slices.Sort(mine)
	if batches != 2 || !slices.Equal(seen, mine) {
		t.Fatalf("EachKeyBatch: %d batches, %d keys; want 2 batches of the %d keys under %s@", batches, len(seen), len(mine), prefix)
	}

	testenv.DropKeys(t, redisURL, prefix)
	if n, err := c.Exists(ctx, mine...).Result(); err != nil || n != 0 {
		t.Fatalf("after DropKeys %d of the prefix's keys exist (%v)", n, err)
	}
	if n, err := c.Exists(ctx, other+"@x", prefix+"-not-under@x").Result(); err != nil || n != 2 {
		t.Fatalf("DropKeys removed keys outside its prefix: %d of 2 left (%v)", n, err)
	}
}
