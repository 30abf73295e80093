package e2e

import (
	"bufio"
	"context"
	"encoding/binary"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestClusterRun plays a short run with the store pool on the shared Redis
// Cluster (three masters, three replicas): every request ok, no wrong byte
// loaded or stored, the ledger balanced, and prefixes loaded from the
// store, whose keys lie on every master.
func TestClusterRun(t *testing.T) {
	c := testenv.RedisCluster(t)
	s := newClusterStack(t, c.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := simConfig(t, s, false, clusterWorkload(24))
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	requireStoreLoads(ctx, t, s, cfg)
	perMaster := clusterKeysPerMaster(t, c.URL(), s.prefix)
	if len(perMaster) != len(c.Masters()) {
		t.Fatalf("the run's keys lie on masters %v, want all of %v", perMaster, c.Masters())
	}
}

// TestClusterFailoverMidRun kills a master of a private cluster in the
// middle of a run and waits until its replica is promoted: the run
// completes with every request ok and no wrong byte loaded or stored.
// Saves that fell in the failover are stored after retries or
// dead-lettered with a reason and reported, never lost (the ledger
// balances); loads that needed the killed master's keys while it was gone
// are load errors the engine recomputed (the simulator checks that each is
// recomputed, never served). No service stops, and the sender's removal
// watcher counts the lost subscription as a gap and subscribes the
// promoted master.
func TestClusterFailoverMidRun(t *testing.T) {
	c := testenv.NewRedisCluster(t)
	s := newClusterStack(t, c.URL())
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := simConfig(t, s, false, clusterWorkload(40))
	progress, done := startRun(ctx, cfg)
	waitProgress(t, progress, done, 10)
	before := c.Masters()
	killed := before[0]
	c.KillMaster(t, killed)
	c.WaitFailover(t, killed)
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	requireOK(t, r.rep)
	v, l := r.rep.Verification, r.rep.Ledger
	t.Logf("after the failover of %s: %d load error blocks, %d tokens recomputed; saves: %d stored, %d existing, %d dead-lettered, %d failed",
		killed, v.LoadErrorBlocks, r.rep.Tokens.Recomputed, l.Stored, l.Existing, l.DeadLettered, l.Failed)
	if v.LoadErrorBlocks > 0 && r.rep.Tokens.Recomputed == 0 {
		t.Fatalf("%d blocks failed to load but no token was recomputed", v.LoadErrorBlocks)
	}
	requireStoreLoads(ctx, t, s, cfg) // the promoted master serves what was replicated to it
	if n := failedOpenLookups(ctx, t, s); n == 0 {
		t.Fatal("no lookup found the store unavailable: the failover did not reach the mesh")
	} else {
		t.Logf("%d lookups failed open while the master was gone", n)
	}
	for _, e := range dlq(t, s, url.Values{}) {
		if e.Reason == "" {
			t.Errorf("dead letter without a reason: %+v", e)
		}
	}
	for _, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"} {
		if err := s.alive(name); err != nil {
			t.Fatal(err)
		}
	}
	if gaps := metricValue(t, s.url("sender"), "kvmesh_sender_evictions_gaps_total"); gaps < 1 {
		t.Errorf("kvmesh_sender_evictions_gaps_total = %v after a master was killed, want at least 1", gaps)
	}
	promoted := slices.DeleteFunc(c.Masters(), func(m string) bool { return slices.Contains(before, m) })
	if len(promoted) != 1 {
		t.Fatalf("masters %v before the failover, %v after: want one promoted", before, c.Masters())
	}
	checkRemovalAnnounced(ctx, t, s, c, promoted[0])
}

// checkRemovalAnnounced sets and deletes a key of the stack's deployment
// that master serves until the sender's removal watcher announces it as
// a BlockRemoved on kvmesh.kv.events: master is subscribed.
func checkRemovalAnnounced(ctx context.Context, t *testing.T, s *stack, c *testenv.Cluster, master string) {
	t.Helper()
	m, err := kvcore.Preset(s.model)
	if err != nil {
		t.Fatal(err)
	}
	kb := kvcore.KeysOf(m).WithPrefix(s.prefix)
	var key string
	for h := uint64(1); key == ""; h++ {
		if k := kb.Key(kvcore.Rank{}, 0, binary.BigEndian.AppendUint64(nil, h)); c.MasterOf(t, k) == master {
			key = k
		}
	}
	co, err := kvstore.RedisClusterOptions(c.URL(), kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cc := redis.NewClusterClient(co)
	defer cc.Close()
	eventually(t, "a BlockRemoved of "+key+", deleted on the promoted master "+master, func() bool {
		// set and delete again each poll: the first DEL may precede the
		// watcher's subscription of the new master
		_ = cc.Set(ctx, key, "v", 0).Err()
		_ = cc.Del(ctx, key).Err()
		recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicKVEvents)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			rec, err := contract.DecodeKVEventRecord(r.Value, r.Headers)
			if err == nil && rec.Kind() == contract.BlockRemoved && slices.Contains(rec.Keys(), key) {
				return true
			}
		}
		return false
	})
}

// failedOpenLookups counts the lookup decisions whose store child could
// not check the store and answered 0 (fail open).
func failedOpenLookups(ctx context.Context, t *testing.T, s *stack) int {
	t.Helper()
	n := 0
	for _, d := range lookupDecisions(ctx, t, s) {
		for _, c := range d.Children {
			if c.Name == "store" && c.Failed != "" {
				if c.Tokens != 0 || c.Spec != nil {
					t.Errorf("decision %s: the store child failed (%s) but answered %d tokens", d.DecisionID, c.Failed, c.Tokens)
				}
				n++
			}
		}
	}
	return n
}

// clusterWorkload is a short single-engine chat workload whose eight
// system prompts do not fit the engine's pool together, so that later
// turns load their prefix from the store (see TestSeedPreset).
func clusterWorkload(requests int) sim.Workload {
	w := smallWorkload(requests, 8)
	w.SystemPrompts = 8
	return w
}

// newClusterStack starts the mesh (the store child only) with its store
// pool on the Redis Cluster at clusterURL; the stack's keys there are
// deleted when the test ends.
func newClusterStack(t *testing.T, clusterURL string) *stack {
	t.Helper()
	var prefix string
	t.Cleanup(func() { dropClusterKeys(t, clusterURL, prefix) }) // runs after the services stopped
	s := newStack(t, stackOptions{model: model, connectors: "store", poolBlocks: 64,
		env: []string{"KVMESH_REDIS_URL=" + clusterURL}})
	s.redisURL, prefix = clusterURL, s.prefix
	return s
}

// eachMasterKeys calls f with each master's client and the keys under
// prefix it holds.
func eachMasterKeys(t *testing.T, clusterURL, prefix string, f func(ctx context.Context, c *redis.Client, keys []string) error) {
	t.Helper()
	co, err := kvstore.RedisClusterOptions(clusterURL, kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cc := redis.NewClusterClient(co)
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		keys, err := c.Keys(ctx, prefix+"@*").Result()
		if err != nil {
			return err
		}
		return f(ctx, c, keys)
	})
	if err != nil {
		t.Errorf("keys under %s on the cluster: %v", prefix, err)
	}
}

// clusterKeysPerMaster counts the keys under prefix on each master that
// holds any.
func clusterKeysPerMaster(t *testing.T, clusterURL, prefix string) map[string]int {
	t.Helper()
	out := map[string]int{}
	var mu sync.Mutex // ForEachMaster calls concurrently
	eachMasterKeys(t, clusterURL, prefix, func(_ context.Context, c *redis.Client, keys []string) error {
		if len(keys) > 0 {
			mu.Lock()
			out[c.Options().Addr] = len(keys)
			mu.Unlock()
		}
		return nil
	})
	return out
}

// dropClusterKeys deletes the keys under prefix from every master.
func dropClusterKeys(t *testing.T, clusterURL, prefix string) {
	t.Helper()
	if prefix == "" {
		return
	}
	eachMasterKeys(t, clusterURL, prefix, func(ctx context.Context, c *redis.Client, keys []string) error {
		_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range keys { // one key a command: a node's keys lie in many slots
				p.Unlink(ctx, k)
			}
			return nil
		})
		return err
	})
}

// metricValue reads one unlabelled sample from a service's /metrics.
func metricValue(t *testing.T, base, name string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			return f
		}
	}
	t.Fatalf("%s/metrics has no sample of %s (%v)", base, name, sc.Err())
	return 0
}
