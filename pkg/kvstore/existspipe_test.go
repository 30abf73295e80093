package kvstore_test

import (
	"context"
	"strings"
	"testing"

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
