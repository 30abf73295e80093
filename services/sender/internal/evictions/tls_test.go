package evictions

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestWatcherOverMutualTLS runs the watcher against a redis-server that
// speaks TLS only, requires a client certificate and has the default user
// off: with the store's TLS settings (Options.RedisTLS), its client
// certificate included, and the URL's ACL user it configures keyspace
// notifications, subscribes and announces a deleted key. TLS settings
// with a plain redis:// URL are refused.
func TestWatcherOverMutualTLS(t *testing.T) {
	certs := testenv.NewCerts(t)
	srv := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{ClientCerts: true})
	files := kvstore.RedisTLS{CAFile: certs.CAFile, CertFile: certs.ClientCert, KeyFile: certs.ClientKey}

	t.Run("with the client certificate", func(t *testing.T) {
		r := &rig{t: t, offsets: map[int]int64{}}
		ctx := r.start(srv.URL(), func(o *Options) { o.RedisTLS = files })
		var err error
		if r.store, err = kvstore.NewRedis(ctx, srv.URL(), kvstore.RedisOptions{TLS: files}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.store.Close() })
		r.waitReady()
		kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}
		deleted := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{0x71, 0x5})
		if err := putOne(ctx, r.store, deleted); err != nil {
			t.Fatal(err)
		}
		if _, err := r.store.Remove(ctx, []string{deleted}); err != nil {
			t.Fatal(err)
		}
		r.until("BlockRemoved for the deleted key", func() bool { return r.removed()[deleted] == CauseDeleted })
	})

	t.Run("TLS settings with a plain URL", func(t *testing.T) {
		metrics, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		_, err = New(Options{
			RedisURL: "redis://" + srv.Addr() + "/0", RedisTLS: files, Keys: kvcore.KeyBuilder{Prefix: "dep", Model: "m"},
			Publisher: discard{}, Metrics: metrics,
		})
		if err == nil || !strings.Contains(err.Error(), "rediss://") {
			t.Errorf("New = %v, want an error asking for rediss://", err)
		}
	})
}

// TestClusterWatcherOverTLS runs the watcher on a Redis Cluster that
// speaks TLS only, named by a rediss+cluster:// URL with an ACL user and
// verified with the test CA (Options.RedisTLS): it subscribes on every
// master and announces the deleted keys, which the cluster spreads over
// its masters.
func TestClusterWatcherOverTLS(t *testing.T) {
	certs := testenv.NewCerts(t)
	c := testenv.StartTLSRedisCluster(t, certs)
	files := kvstore.RedisTLS{CAFile: certs.CAFile}
	r := &rig{t: t, offsets: map[int]int64{}}
	ctx := r.start(c.URL(), func(o *Options) {
		o.RedisTLS = files
		o.TopologyEvery = 50 * time.Millisecond
	})
	var err error
	if r.store, err = kvstore.NewRedis(ctx, c.URL(), kvstore.RedisOptions{TLS: files}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.store.Close() })
	r.waitReady()
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}
	// Enough keys that every master holds some (16384 slots in three ranges).
	var keys []string
	for i := range 30 {
		keys = append(keys, kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{0x7c, byte(i)}))
	}
	for _, k := range keys {
		if err := putOne(ctx, r.store, k); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.store.Remove(ctx, keys); err != nil {
		t.Fatal(err)
	}
	r.until("BlockRemoved for every deleted key", func() bool {
		got := r.removed()
		for _, k := range keys {
			if got[k] != CauseDeleted {
				return false
			}
		}
		return true
	})
}

// putOne stores key with a small value.
func putOne(ctx context.Context, st kvstore.Store, key string) error {
	errs, err := st.Put(ctx, []kvstore.Item{{Key: key, Value: []byte("v")}})
	if err != nil {
		return err
	}
	return errs[0]
}

// discard is a Publisher that drops every record.
type discard struct{}

// Publish drops msgs.
func (discard) Publish(context.Context, ...bus.Message) error { return nil }
