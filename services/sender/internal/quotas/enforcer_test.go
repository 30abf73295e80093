package quotas

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// quotaRig is an Enforcer on real PostgreSQL and Redis, each tenant with
// one namespace of 100-byte values.
type quotaRig struct {
	e      *Enforcer
	store  *kvstore.Redis
	client *redis.Client
	prefix string
}

func newQuotaRig(t *testing.T) *quotaRig {
	t.Helper()
	url := testenv.StartRedis(t).URL() // a server of its own: the shared one may be full and evict the idle keys the test sets up
	store, err := kvstore.NewRedis(context.Background(), url, kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	ro, _ := redis.ParseURL(url)
	client := redis.NewClient(ro)
	t.Cleanup(func() { _ = client.Close() })
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	r := &quotaRig{store: store, client: client, prefix: "quota-test-" + hex.EncodeToString(b)}
	t.Cleanup(func() { testenv.DropKeys(t, url, r.prefix) })
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	r.e, err = New(Options{Table: NewTable(dbtest.NewPool(t)), Store: store, StoreTimes: store, Metrics: m,
		Spaces: func(tenant string) []Space { return []Space{{Namespace: r.ns(tenant), ValueBytes: 100}} }})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *quotaRig) ns(tenant string) string { return r.prefix + "@m@tenant:" + tenant + "@g" }

func (r *quotaRig) key(tenant string, i int) string {
	return fmt.Sprintf("%s@%064x", r.ns(tenant), i+1)
}

// stored puts tenant's key i (unless ghost: then only its index entry)
// stored at at, idle for idle seconds.
func (r *quotaRig) stored(t *testing.T, tenant string, i int, at time.Time, idle int, ghost bool) string {
	t.Helper()
	ctx := context.Background()
	k := r.key(tenant, i)
	if err := r.store.MarkStored(ctx, []string{k}, at); err != nil {
		t.Fatal(err)
	}
	if ghost {
		return k
	}
	if err := r.client.Set(ctx, k, "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	dump, err := r.client.Dump(ctx, k).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.client.Do(ctx, "RESTORE", k, 0, dump, "REPLACE", "IDLETIME", idle).Err(); err != nil {
		t.Fatal(err)
	}
	return k
}

func (r *quotaRig) present(t *testing.T, keys ...string) []bool {
	t.Helper()
	found, err := r.store.Exists(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// TestEnforcerEvictsTheTenantsLeastRecentlyUsed: over holds five index
// entries (one of a block already gone) under a five-key quota; a save of
// two new keys forgets the gone entry and removes the idlest of the
// oldest blocks (not the oldest, which was just used), marks it for the
// removal watcher, and admits both; calm, with no quota, keeps every
// block and is admitted whole.
func TestEnforcerEvictsTheTenantsLeastRecentlyUsed(t *testing.T) {
	r := newQuotaRig(t)
	ctx := context.Background()
	t0 := time.Unix(1_800_000_000, 0)
	ghost := r.stored(t, "over", 0, t0, 0, true)
	k1 := r.stored(t, "over", 1, t0.Add(time.Second), 5, false)
	k2 := r.stored(t, "over", 2, t0.Add(2*time.Second), 5000, false)
	k3 := r.stored(t, "over", 3, t0.Add(3*time.Second), 3000, false)
	k4 := r.stored(t, "over", 4, t0.Add(4*time.Second), 10, false)
	calm := r.stored(t, "calm", 1, t0, 9000, false)
	if _, err := r.e.Set(ctx, Quota{Tenant: "over", MaxKeys: 5}); err != nil {
		t.Fatal(err)
	}
	n, release := r.e.Admit(ctx, "over", []string{r.key("over", 10), r.key("over", 11)})
	release()
	if n != 2 {
		t.Fatalf("admitted %d of 2", n)
	}
	if got := r.present(t, k1, k2, k3, k4, calm); !got[0] || got[1] || !got[2] || !got[3] || !got[4] {
		t.Fatalf("present k1..k4, calm = %v; want only k2 (the idlest) removed", got)
	}
	marks, err := r.store.TakeQuotaMarks(ctx, []string{ghost, k2})
	if err != nil || !marks[0].IsZero() || !marks[1].Equal(t0.Add(2*time.Second)) {
		t.Fatalf("marks of the gone entry and k2: %v, %v; want only k2's, with its store time", marks, err)
	}
	st, err := r.e.Status(ctx, "over")
	if err != nil || st.UsageKeys != 3 || st.UsageBytes != 300 || st.EvictedBlocks != 1 || st.SkippedBlocks != 0 {
		t.Fatalf("Status = %+v, %v; want 3 keys of 100 bytes, 1 evicted", st, err)
	}
	if got := testutil.ToFloat64(r.e.opts.Metrics.evicted.WithLabelValues("over")); got != 1 {
		t.Errorf("evicted{over} = %v, want 1", got)
	}
	if !r.e.Note("over") || r.e.Note("calm") {
		t.Fatal("Note: want over limited and calm not")
	}
	if n, release := r.e.Admit(ctx, "calm", []string{r.key("calm", 2)}); n != 1 {
		t.Fatalf("calm, no quota: admitted %d of 1", n)
	} else {
		release()
	}
}

// TestEnforcerSkipsAndReserves: with on_full skip, only what fits is
// admitted and nothing is removed; keys admitted but not yet released
// count against the quota; a quota in bytes binds as one in keys does.
func TestEnforcerSkipsAndReserves(t *testing.T) {
	r := newQuotaRig(t)
	ctx := context.Background()
	t0 := time.Unix(1_800_000_000, 0)
	k1 := r.stored(t, "over", 1, t0, 100, false)
	k2 := r.stored(t, "over", 2, t0, 100, false)
	if _, err := r.e.Set(ctx, Quota{Tenant: "over", MaxBytes: 400, OnFull: adminapi.QuotaSkip}); err != nil {
		t.Fatal(err)
	}
	n1, release1 := r.e.Admit(ctx, "over", []string{r.key("over", 3)})
	n2, release2 := r.e.Admit(ctx, "over", []string{r.key("over", 4), r.key("over", 5)}) // room for one: the first is reserved
	release2()
	if n1 != 1 || n2 != 1 {
		t.Fatalf("admitted %d then %d; want 1 then 1 of 2", n1, n2)
	}
	release1()
	if n, release := r.e.Admit(ctx, "over", []string{r.key("over", 6), r.key("over", 7), r.key("over", 8)}); n != 2 {
		t.Fatalf("after the releases: admitted %d of 3, want 2 (200 bytes free)", n)
	} else {
		release()
	}
	if got := r.present(t, k1, k2); !got[0] || !got[1] {
		t.Fatalf("a skip quota removed a block: %v", got)
	}
	st, err := r.e.Status(ctx, "over")
	if err != nil || st.SkippedBlocks != 2 || st.EvictedBlocks != 0 {
		t.Fatalf("Status = %+v, %v; want 2 skipped, none evicted", st, err)
	}
}

// TestEnforcerFailsClosed: when the tenant's usage cannot be read, a
// tenant with a quota is admitted nothing (another tenant's room is never
// taken on trust); a tenant without one is admitted whole.
func TestEnforcerFailsClosed(t *testing.T) {
	r := newQuotaRig(t)
	ctx := context.Background()
	if _, err := r.e.Set(ctx, Quota{Tenant: "over", MaxKeys: 100}); err != nil {
		t.Fatal(err)
	}
	if err := r.store.Close(); err != nil {
		t.Fatal(err)
	}
	if n, release := r.e.Admit(ctx, "over", []string{r.key("over", 1)}); n != 0 {
		t.Fatalf("with the store closed: admitted %d, want 0", n)
	} else {
		release()
	}
	if n, _ := r.e.Admit(ctx, "calm", []string{r.key("calm", 1)}); n != 1 {
		t.Fatalf("no quota, store closed: admitted %d, want 1", n)
	}
}

// TestSpacesOf: a tenant's spaces are every group's store namespaces of
// every served model, each value its group's bytes per block plus the
// frame.
func TestSpacesOf(t *testing.T) {
	var ms []*kvcore.Model
	for _, name := range []string{"hybrid-mla-linear-tp8", "dense"} {
		m, err := kvcore.Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	models, err := kvcore.NewModels("dep", ms...)
	if err != nil {
		t.Fatal(err)
	}
	spaces := SpacesOf(models, func(n int) int { return 18 + n })("acme")
	want, perModel := 0, map[string]int{}
	for _, m := range ms {
		for g := range m.Groups {
			want += len(m.Namespaces(g))
		}
	}
	if len(spaces) != want {
		t.Fatalf("%d spaces, want %d", len(spaces), want)
	}
	for _, s := range spaces {
		p, err := kvcore.ParseKey(s.Namespace + "@" + fmt.Sprintf("%064x", 1))
		if err != nil || p.Tenant != "acme" || s.ValueBytes <= int64(18+16) {
			t.Errorf("space %+v: %+v, %v; want a key of tenant acme with a framed value", s, p, err)
		}
		perModel[p.Model]++
	}
	if len(perModel) != 2 {
		t.Errorf("spaces per model %v, want both models", perModel)
	}
}

// TestEnforcerConcurrentAdmits: saves of one tenant admitted at once, each
// storing what it was admitted before releasing it (as the sender's puts
// do), never leave the tenant over its evicting quota: two admissions
// reading the same usage would each evict the same idlest blocks, count
// them freed and admit as many new ones.
func TestEnforcerConcurrentAdmits(t *testing.T) {
	r := newQuotaRig(t)
	ctx := context.Background()
	const limit, saves, each = 8, 8, 2
	t0 := time.Now().Add(-time.Hour)
	for i := range limit {
		r.stored(t, "busy", i, t0.Add(time.Duration(i)*time.Second), 100+i, false)
	}
	if _, err := r.e.Set(ctx, Quota{Tenant: "busy", MaxKeys: limit}); err != nil {
		t.Fatal(err)
	}
	var g errgroup.Group
	for s := range saves {
		g.Go(func() error {
			keys := []string{r.key("busy", 100+s*each), r.key("busy", 101+s*each)}
			n, release := r.e.Admit(ctx, "busy", keys)
			defer release()
			for i := range n {
				if err := r.client.Set(ctx, keys[i], "v", 0).Err(); err != nil {
					return err
				}
				if err := r.store.MarkStored(ctx, keys[i:i+1], time.Now()); err != nil { // after the put, as a gpuworker does
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	st, err := r.e.Status(ctx, "busy")
	if err != nil || st.UsageKeys > limit {
		t.Fatalf("Status = %+v, %v; want at most %d keys after %d concurrent saves", st, err, limit, saves)
	}
	t.Logf("after %d concurrent saves of %d keys: %d keys, %d evicted, %d skipped", saves, each, st.UsageKeys, st.EvictedBlocks, st.SkippedBlocks)
}
