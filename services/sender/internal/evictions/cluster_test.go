package evictions

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// newClusterRig runs a watcher on c, with a cluster client for the test's
// own commands.
func newClusterRig(t *testing.T, c *testenv.Cluster, tweak func(*Options)) *clusterRig {
	t.Helper()
	co, err := kvstore.RedisClusterOptions(c.URL(), kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// go-redis reloads its slot map on MOVED replies and every
	// ClusterStateReloadInterval only, not when a master stops answering.
	co.ClusterStateReloadInterval = 100 * time.Millisecond
	r := &clusterRig{rig: &rig{t: t, offsets: map[int]int64{}}, cluster: c, cc: redis.NewClusterClient(co)}
	t.Cleanup(func() { _ = r.cc.Close() })
	r.start(c.URL(), func(o *Options) {
		o.TopologyEvery = 50 * time.Millisecond
		o.Backoff.Initial, o.Backoff.Max = 20*time.Millisecond, 200*time.Millisecond
		if tweak != nil {
			tweak(o)
		}
	})
	return r
}

// clusterRig is a rig whose store is a Redis Cluster.
type clusterRig struct {
	*rig
	cluster *testenv.Cluster
	cc      *redis.ClusterClient
}

// node is a client of one node of the cluster, closed with the test.
func (r *clusterRig) node(addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr})
	r.t.Cleanup(func() { _ = c.Close() })
	return c
}

// keysOn returns n store keys of group 0 of the rig's deployment that the
// cluster's master addr serves, their hashes starting at seed.
func (r *clusterRig) keysOn(addr string, n int, seed uint64) []string {
	r.t.Helper()
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}
	var out []string
	for h := seed; len(out) < n; h++ {
		if h > seed+100000 {
			r.t.Fatalf("no key of master %s among 100000", addr)
		}
		k := kb.Key(kvcore.Rank{}, 0, binary.BigEndian.AppendUint64(nil, h))
		m, err := r.cc.MasterForKey(context.Background(), k)
		if err != nil {
			r.t.Fatal(err)
		}
		if m.Options().Addr == addr {
			out = append(out, k)
		}
	}
	return out
}

// announced sets and deletes key until a BlockRemoved (del) names it: the
// first DEL may precede the subscription of the key's master.
func (r *clusterRig) announced(phase, key string) {
	r.t.Helper()
	ctx := context.Background()
	r.until(phase+": BlockRemoved of deleted "+key, func() bool {
		_ = r.cc.Set(ctx, key, "v", 0).Err()
		_ = r.cc.Del(ctx, key).Err()
		return r.removed()[key] == CauseDeleted
	})
}

// running fails the test when the watcher stopped.
func (r *clusterRig) running(phase string) {
	r.t.Helper()
	select {
	case err := <-r.done:
		r.t.Fatalf("%s: the watcher stopped: %v", phase, err)
	default:
	}
}

// TestClusterRemovalsAreAnnounced runs the watcher on a private 3-master
// cluster: a key deleted, one expired and keys evicted on every master are
// announced with their causes (notifications are node-local, so this
// needs a subscription per master); every master holds a marker of its
// own; and a FLUSHALL of one master (FLUSHALL is per node) clears the
// deployment.
func TestClusterRemovalsAreAnnounced(t *testing.T) {
	c := testenv.NewRedisCluster(t)
	refusedOnCluster(t, c)
	r := newClusterRig(t, c, func(o *Options) { o.MarkerEvery = 100 * time.Millisecond })
	r.waitReady()
	ctx := context.Background()
	masters := c.Masters()
	if len(masters) != 3 {
		t.Fatalf("masters %v, want 3", masters)
	}
	deleted, expired := map[string]string{}, map[string]string{}
	for i, m := range masters {
		ks := r.keysOn(m, 2, uint64(i)<<32)
		deleted[m], expired[m] = ks[0], ks[1]
		if err := r.cc.Set(ctx, ks[0], "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
		if err := r.cc.Del(ctx, ks[0]).Err(); err != nil {
			t.Fatal(err)
		}
		if err := r.cc.Set(ctx, ks[1], "v", 30*time.Millisecond).Err(); err != nil {
			t.Fatal(err)
		}
	}
	r.until("BlockRemoved for a deleted and an expired key of every master", func() bool {
		got := r.removed()
		for _, m := range masters {
			if got[deleted[m]] != CauseDeleted || got[expired[m]] != CauseExpired {
				return false
			}
		}
		return true
	})
	for _, m := range masters {
		markers, err := r.node(m).Keys(ctx, markerPrefix+"*").Result()
		if err != nil || len(markers) != 1 {
			t.Errorf("master %s holds markers %v (%v), want one of its own", m, markers, err)
		}
	}
	evicted := r.evictOnEveryMaster(masters)
	r.until(fmt.Sprintf("BlockRemoved (evicted) for all %d evicted keys", len(evicted)), func() bool {
		got := r.removed()
		for _, k := range evicted {
			if got[k] != CauseEvicted {
				return false
			}
		}
		return true
	})

	if err := r.node(masters[1]).FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	r.until("AllBlocksCleared after a FLUSHALL of one master", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, rec := range r.records {
			if rec.Kind() == contract.AllBlocksCleared && rec.Namespace == "dep@m" && rec.Cause == CauseFlushed {
				return true
			}
		}
		return false
	})
	r.running("at the end")
}

// refusedOnCluster: a watcher that may not configure a cluster whose
// masters have notifications off stops with ErrNotifyDisabled before it
// subscribes, as on a single server (c must have them off).
func refusedOnCluster(t *testing.T, c *testenv.Cluster) {
	t.Helper()
	m, _ := NewMetrics(prometheus.NewRegistry())
	w, err := New(Options{RedisURL: c.URL(), Keys: kvcore.KeyBuilder{Model: "m"}, Publisher: nopPublisher{}, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := w.Run(ctx); !errors.Is(err, ErrNotifyDisabled) {
		t.Fatalf("Run on a cluster with notifications off, not configuring: %v, want ErrNotifyDisabled", err)
	}
}

// evictOnEveryMaster gives every master a maxmemory 2 MiB above what it
// uses (the replication backlog, 1 MiB, fills as the values are written),
// with allkeys-lru, and writes 16 KiB values of keys it serves until
// it has evicted some; it returns the keys evicted.
func (r *clusterRig) evictOnEveryMaster(masters []string) []string {
	r.t.Helper()
	ctx := context.Background()
	var evicted []string
	value := make([]byte, 16<<10)
	for i, m := range masters {
		n := r.node(m)
		used := usedMemory(r.t, n)
		for _, kv := range [][2]string{{"maxmemory-policy", "allkeys-lru"}, {"maxmemory", strconv.Itoa(used + 2<<20)}} {
			if err := n.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
				r.t.Fatal(err)
			}
		}
		keys := r.keysOn(m, 256, uint64(i+1)<<40) // 4 MiB of values
		for j, k := range keys {
			if err := n.Set(ctx, k, value, 0).Err(); err != nil {
				info, _ := n.Info(ctx, "memory").Result()
				r.t.Fatalf("%d: %v; used before %d\n%s", j, err, used, info)
			}
		}
		var gone []string
		for _, k := range keys {
			if n.Exists(ctx, k).Val() == 0 {
				gone = append(gone, k)
			}
		}
		if len(gone) == 0 || len(gone) == len(keys) {
			r.t.Fatalf("master %s evicted %d of %d keys: it did not fill past maxmemory as planned", m, len(gone), len(keys))
		}
		evicted = append(evicted, gone...)
	}
	return evicted
}

// usedMemory is the node's INFO used_memory.
func usedMemory(t *testing.T, c *redis.Client) int {
	t.Helper()
	info, err := c.Info(context.Background(), "memory").Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no used_memory in INFO memory: %q", info)
	return 0
}

// TestClusterFailoverResubscribes kills a master of a private cluster:
// its replica, once promoted, is subscribed (a key deleted on it is
// announced), the lost subscription is a gap, the other masters are
// announced throughout, and the watcher never stops.
func TestClusterFailoverResubscribes(t *testing.T) {
	c := testenv.NewRedisCluster(t)
	r := newClusterRig(t, c, nil)
	r.waitReady()
	masters := c.Masters()
	killed, other := masters[0], masters[1]
	ks := r.keysOn(killed, 2, 1)
	before, after := ks[0], ks[1]
	r.announced("before the failover", before)
	otherKey := r.keysOn(other, 1, 7<<32)[0]

	c.KillMaster(t, killed)
	c.WaitFailover(t, killed)
	promoted := c.MasterOf(t, after)
	if promoted == killed {
		t.Fatalf("%s still serves %s after the failover", killed, after)
	}
	failedOver := time.Now()
	r.announced("on the promoted replica", after)
	t.Logf("killed %s; %s promoted; a removal on it announced %v after the failover", killed, promoted, time.Since(failedOver).Round(time.Millisecond))
	r.announced("on another master", otherKey)
	r.running("after the failover")
	if g := testutil.ToFloat64(r.metrics.gaps); g < 1 {
		t.Errorf("gaps = %v after a master was killed, want at least 1", g)
	}
	flags := r.node(promoted).ConfigGet(context.Background(), "notify-keyspace-events").Val()["notify-keyspace-events"]
	if missingFlags(flags) != "" {
		t.Errorf("promoted master's notify-keyspace-events %q: the watcher did not configure it", flags)
	}
}

// TestClusterMarkerKeys: a cluster node's marker key is outside every
// deployment's key space and never parses as a store key, and its hash
// tag differs by index.
func TestClusterMarkerKeys(t *testing.T) {
	tests := []struct {
		scope string
		i     int
		want  string
	}{
		{"m", 0, "kvmesh-evictions-marker@{0}m"},
		{"dep@m", 12, "kvmesh-evictions-marker@{12}dep@m"},
	}
	for _, tc := range tests {
		got := clusterMarkerKey(tc.scope, tc.i)
		if got != tc.want {
			t.Errorf("clusterMarkerKey(%q, %d) = %q, want %q", tc.scope, tc.i, got, tc.want)
		}
		if _, err := kvcore.ParseKey(got); err == nil {
			t.Errorf("marker %q parses as a store key", got)
		}
		if !strings.HasPrefix(got, markerPrefix) {
			t.Errorf("marker %q lacks the marker prefix", got)
		}
	}
}
