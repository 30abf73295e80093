package kvstore_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestExistsPipeAuthAndDatabase checks that the store's own EXISTS
// connections authenticate as the URL's user and select its database: a key
// stored in database 3 is found there and not in database 0.
func TestExistsPipeAuthAndDatabase(t *testing.T) {
	srv := testenv.StartRedis(t)
	base := strings.TrimSuffix(strings.TrimPrefix(srv.URL(), "redis://"), "/0")
	ctx := context.Background()
	if err := rawClient(t, srv.URL()).Do(ctx, "ACL", "SETUSER", "kv", "on", ">secret", "~*", "+@all").Err(); err != nil {
		t.Fatalf("ACL SETUSER: %v", err)
	}
	db3 := newRedis(t, "redis://kv:secret@"+base+"/3", kvstore.RedisOptions{})
	db0 := newRedis(t, "redis://kv:secret@"+base+"/0", kvstore.RedisOptions{})
	keys := testKeys(t, db3, 2)
	if err := putAll(db3, kvstore.Item{Key: keys[0], Value: []byte("v")}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		r    *kvstore.Redis
		want []bool
	}{{"db 3", db3, []bool{true, false}}, {"db 0", db0, []bool{false, false}}} {
		got, err := tc.r.Exists(ctx, keys)
		if err != nil || len(got) != 2 || got[0] != tc.want[0] || got[1] != tc.want[1] {
			t.Errorf("%s: Exists = %v, %v; want %v", tc.name, got, err, tc.want)
		}
		if n, ok := kvstore.ExistsPipelines(tc.r); !ok || n == 0 {
			t.Errorf("%s: Exists did not go over the store's own pipeline (%d, %v)", tc.name, n, ok)
		}
	}
	if r, err := kvstore.NewRedis(ctx, "redis://kv:wrong@"+base+"/3", kvstore.RedisOptions{}); err == nil {
		_ = r.Close()
		t.Error("NewRedis with a wrong password succeeded")
	}
}

// TestExistsPipeSurvivesServerRestart checks that an idle EXISTS connection
// the server closed (it restarted) is replaced, not reported as an outage.
func TestExistsPipeSurvivesServerRestart(t *testing.T) {
	srv := testenv.StartRedis(t)
	r := newRedis(t, srv.URL(), kvstore.RedisOptions{})
	ctx := context.Background()
	keys := testKeys(t, r, 3)
	if _, err := r.Exists(ctx, keys); err != nil { // leaves an idle connection
		t.Fatal(err)
	}
	srv.Stop()
	testenv.RestartRedis(t, srv)
	if err := putAll(r, kvstore.Item{Key: keys[1], Value: []byte("v")}); err != nil {
		t.Fatalf("Put after the restart: %v", err)
	}
	got, err := r.Exists(ctx, keys)
	if err != nil || got[0] || !got[1] || got[2] {
		t.Errorf("Exists after the restart = %v, %v; want [false true false]", got, err)
	}
}

// TestGetEach checks that GetEach answers as Get does, key by key in input
// order, on a single server (the store's own GET pipeline, values in one
// reused buffer), on a cluster and through the Get fallback of a store
// without it: present, absent, empty and growing values, duplicate keys,
// use's error as the key's error, and pipelines bounded by MaxBatchKeys.
func TestGetEach(t *testing.T) {
	m, err := kvstore.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	stores := map[string]kvstore.Store{
		"redis":      newRedis(t, testenv.RedisURL(t), kvstore.RedisOptions{MaxBatchKeys: 3}),
		"cluster":    newRedis(t, testenv.RedisCluster(t).URL(), kvstore.RedisOptions{MaxBatchKeys: 3}),
		"memory":     kvstore.NewMemory(kvstore.MemoryOptions{}),
		"instrument": kvstore.Instrument(newRedis(t, testenv.RedisURL(t), kvstore.RedisOptions{}), m, kvstore.OpNames{}),
	}
	errUse := errors.New("use refused")
	for name, st := range stores {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			keys := testKeys(t, st, 6)
			values := [][]byte{[]byte("small"), nil, bytes.Repeat([]byte{7}, 3<<20), []byte{}, []byte("after a big one"), nil}
			var items []kvstore.Item
			for i, v := range values {
				if v != nil || i == 3 {
					items = append(items, kvstore.Item{Key: keys[i], Value: v})
				}
			}
			if err := putAll(st, items...); err != nil {
				t.Fatal(err)
			}
			ask := append(keys[:6:6], keys[0])
			var got [][]byte
			seen := map[int]bool{}
			errs, err := kvstore.GetEach(ctx, st, ask, func(i int, v []byte) error {
				seen[i] = true
				if i == 4 {
					return errUse
				}
				for len(got) <= i {
					got = append(got, nil)
				}
				got[i] = append([]byte{}, v...)
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for i, want := range append(values[:6:6], values[0]) {
				switch {
				case i == 4:
					if !errors.Is(errs[i], errUse) {
						t.Errorf("key %d: %v, want use's error", i, errs[i])
					}
				case want == nil && i != 3:
					if !errors.Is(errs[i], kvstore.ErrNotFound) || seen[i] {
						t.Errorf("key %d: %v (use called %v), want ErrNotFound and no call", i, errs[i], seen[i])
					}
				default:
					if errs[i] != nil || i >= len(got) || !bytes.Equal(got[i], want) {
						t.Errorf("key %d: error %v, %d bytes; want %d bytes", i, errs[i], len(got[min(i, len(got)-1)]), len(want))
					}
				}
			}
		})
	}
}
