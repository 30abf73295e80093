package app_test

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// quotaRun is what one two-tenant run left: per tenant the keys its saves
// stored and how many are still in the store.
type quotaRun struct {
	stored  map[string][]string
	present map[string]int
}

// TestTenantQuotas: against real redis-server with maxmemory and
// allkeys-lru, a single node and a Redis Cluster (the real gpuworker
// putting, the sender's removal watcher announcing), tenant calm stores
// its blocks, then tenant over saves four times its byte quota. The quota
// evicts over's own least recently used blocks: its usage stays within the
// quota, its newest saves are stored, and the blocks it lost are announced
// as BlockRemoved with cause quota, tenant over and their ages, logged
// (GET /v1/removals) and counted; every block of calm stays (its hit rate
// is unaffected) and none of its removals is announced. With on_full skip
// the next save of over stores nothing and is skipped with reason quota,
// evicting nothing. The single node also runs the control: without the
// quota, over's saves push calm's blocks out of the full store.
func TestTenantQuotas(t *testing.T) {
	t.Run("single", func(t *testing.T) {
		redisURL := testenv.StartRedis(t, "--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru").URL()
		run := quotaScenario(t, redisURL, true)
		checkCalmUnaffected(t, run)

		control := testenv.StartRedis(t, "--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru").URL()
		without := quotaScenario(t, control, false)
		if lost := len(without.stored["calm"]) - without.present["calm"]; lost == 0 {
			t.Fatalf("control without a quota: calm lost none of its %d blocks; the store did not fill as planned", len(without.stored["calm"]))
		}
		t.Logf("with over's quota calm kept %d of %d blocks; without it %d of %d", run.present["calm"], len(run.stored["calm"]),
			without.present["calm"], len(without.stored["calm"]))
	})
	t.Run("cluster", func(t *testing.T) {
		c := testenv.NewRedisCluster(t)
		limitMasters(t, c.Masters(), 8<<20)
		checkCalmUnaffected(t, quotaScenario(t, c.URL(), true))
	})
}

// checkCalmUnaffected fails unless every block calm stored is present.
func checkCalmUnaffected(t *testing.T, run quotaRun) {
	t.Helper()
	if n := len(run.stored["calm"]); n == 0 || run.present["calm"] != n {
		t.Fatalf("calm holds %d of the %d blocks it stored; want all (hit rate unaffected)", run.present["calm"], n)
	}
}

// limitMasters gives every master maxmemory room above what it uses now,
// and allkeys-lru.
func limitMasters(t *testing.T, masters []string, room int) {
	t.Helper()
	for _, m := range masters {
		c := redis.NewClient(&redis.Options{Addr: m})
		ctx := context.Background()
		info, err := c.Info(ctx, "memory").Result()
		if err != nil {
			t.Fatal(err)
		}
		used := 0
		for _, line := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
				used, _ = strconv.Atoi(v)
			}
		}
		for _, kv := range [][2]string{{"maxmemory-policy", "allkeys-lru"}, {"maxmemory", strconv.Itoa(used + room)}} {
			if err := c.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
				t.Fatal(err)
			}
		}
		_ = c.Close()
	}
}

// quotaScenario plays calm's saves, then over's, on the store at
// redisURL, with over's byte quota (evict) when quota is set, and checks
// what the quota promises; it returns what each tenant stored and kept.
func quotaScenario(t *testing.T, redisURL string, quota bool) quotaRun {
	t.Helper()
	s := newStack(t, stackOptions{engines: []string{"e1"}, workerRedis: redisURL, senderRedis: redisURL,
		config: func(c *app.Config) { c.Evictions, c.EvictionsConfigure = true, true }})
	s.awaitWatcher(t)
	const limit = 2 << 20
	if quota {
		var q adminapi.TenantQuota
		if code := s.doBody(t, http.MethodPut, "/v1/quotas/over", `{"max_bytes": 2097152}`, &q); code != http.StatusOK || q.OnFull != adminapi.QuotaEvict {
			t.Fatalf("PUT quota: %d %+v", code, q)
		}
	}
	run := quotaRun{stored: map[string][]string{}, present: map[string]int{}}
	var lastTask *kvcore.SaveTask
	save := func(tenant string, i int) contract.TransferResult {
		task := s.task(t, "e1", fmt.Sprintf("%s-%d", tenant, i), 0, 64, kvcore.BlockID(i*4%60))
		task.Tenant = tenant
		lastTask = task
		s.publish(t, task)
		res := s.got.result(t, task.TaskID)
		for g := range s.model.Groups {
			run.stored[tenant] = append(run.stored[tenant], s.keys(t, task, g)...)
		}
		return res
	}
	for i := range 4 {
		if res := save("calm", i); res.Status != "stored" {
			t.Fatalf("calm's save %d: %+v", i, res)
		}
	}
	var last contract.TransferResult
	for i := range 16 {
		last = save("over", i)
		if last.Status != "stored" {
			t.Fatalf("over's save %d: %+v; want stored (its own blocks make room)", i, last)
		}
	}
	for tenant, keys := range run.stored {
		run.present[tenant] = len(keys) - s.missing(t, keys)
	}
	if !quota {
		return run
	}

	var st adminapi.QuotaStatus
	if code := s.doBody(t, http.MethodGet, "/v1/quotas/over", "", &st); code != http.StatusOK {
		t.Fatalf("GET quota: %d", code)
	}
	t.Logf("over: quota %d bytes (%s), usage %d bytes in %d keys, %d blocks evicted, %d skipped; kept %d of the %d blocks its saves stored; calm kept %d of %d",
		st.MaxBytes, st.OnFull, st.UsageBytes, st.UsageKeys, st.EvictedBlocks, st.SkippedBlocks,
		run.present["over"], len(run.stored["over"]), run.present["calm"], len(run.stored["calm"]))
	if st.UsageBytes == 0 || st.UsageBytes > limit || st.EvictedBlocks == 0 || st.SkippedBlocks != 0 {
		t.Fatalf("over's quota status %+v; want usage within %d bytes after evictions, nothing skipped", st, limit)
	}
	lastKeys := s.keys(t, lastTask, 0)
	if n := s.missing(t, lastKeys); n != 0 {
		t.Fatalf("%d of over's newest save's keys missing; the evictions should have made room for them", n)
	}
	checkQuotaRemovals(t, s, st.EvictedBlocks)

	// on_full skip: a save past the quota stores nothing and evicts nothing.
	if code := s.doBody(t, http.MethodPut, "/v1/quotas/over", fmt.Sprintf(`{"max_bytes": %d, "on_full": "skip"}`, st.UsageBytes), nil); code != http.StatusOK {
		t.Fatalf("PUT skip quota: %d", code)
	}
	res := save("over", 99)
	if res.Status != "skipped" || groupOf(res, 0).Stored != 0 || groupOf(res, 0).Skipped == 0 || groupOf(res, 0).Reason != string(kvcore.ReasonQuota) {
		t.Fatalf("over's save past a skip quota: %+v; want skipped with reason quota", res)
	}
	var after adminapi.QuotaStatus
	if code := s.doBody(t, http.MethodGet, "/v1/quotas/over", "", &after); code != http.StatusOK || after.EvictedBlocks != st.EvictedBlocks || after.SkippedBlocks == 0 {
		t.Fatalf("after a skipped save: %d %+v; want the same evictions and skipped blocks counted", code, after)
	}
	s.checkMetrics(t, `kvmesh_sender_tenant_quota_bytes{tenant="over"}`, `kvmesh_sender_quota_evicted_blocks_total{tenant="over"}`,
		`kvmesh_sender_quota_skipped_blocks_total{tenant="over"}`, `kvmesh_sender_block_removed_total{cause="quota"}`)
	return run
}

// checkQuotaRemovals waits until the watcher announced evicted blocks of
// over with cause quota, each with an age, none of calm's, and the
// removals log answers them.
func checkQuotaRemovals(t *testing.T, s *stack, evicted int64) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for s.got.removedBlocks("over", "quota") < int(evicted) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of over's blocks announced removed for its quota, %d evicted; announced: over del %d, evicted %d",
				s.got.removedBlocks("over", "quota"), evicted, s.got.removedBlocks("over", "del"), s.got.removedBlocks("over", "evicted"))
		}
		time.Sleep(10 * time.Millisecond) // polling interval, not synchronisation
	}
	for _, r := range s.got.removals() {
		if r.Tenant == "calm" {
			t.Fatalf("a removal of calm's blocks was announced: %+v", r)
		}
		if r.Cause == "quota" {
			for _, a := range r.Ages {
				if a < 0 {
					t.Fatalf("a quota removal without its age: %+v", r)
				}
			}
		}
	}
	var log adminapi.Removals
	poll(t, "the quota's removals logged", func() bool {
		if code := s.doBody(t, http.MethodGet, "/v1/removals?tenant=over&cause=quota", "", &log); code != http.StatusOK {
			t.Fatalf("GET removals: %d", code)
		}
		return len(log.ByCause) == 1 && log.ByCause[0].Blocks >= evicted && log.ByCause[0].AgesKnown == log.ByCause[0].Blocks
	})
	var calm adminapi.Removals
	if code := s.doBody(t, http.MethodGet, "/v1/removals?tenant=calm", "", &calm); code != http.StatusOK || len(calm.ByCause) != 0 {
		t.Fatalf("calm's removals: %d %+v; want none", code, calm.ByCause)
	}
}
