package removals

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// removed is a BlockRemoved record of n blocks of tenant, cause and ages
// at time at.
func removed(at time.Time, tenant, cause string, ages ...float64) contract.KVEventRecord {
	hashes := make([]string, len(ages))
	for i := range hashes {
		hashes[i] = "ab"
	}
	group := 0
	return contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: contract.UnixSeconds(at), Events: []contract.KVEvent{{Kind: contract.BlockRemoved, GroupIdx: &group}}},
		Model: "m", Fingerprint: "00112233445566ff", Tenant: tenant, Namespace: "dep@m@ns-" + tenant, Cause: cause,
		Hashes: hashes, Ages: ages,
	}
}

// cleared is an AllBlocksCleared record of the deployment at time at.
func cleared(at time.Time) contract.KVEventRecord {
	return contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: contract.UnixSeconds(at), Events: []contract.KVEvent{{Kind: contract.AllBlocksCleared}}},
		Model: "m", Namespace: "dep@m", Cause: "flushed",
	}
}

// TestRecordAndQuery: removals recorded on a real PostgreSQL schema are
// answered per tenant (the empty tenant apart from every tenant), cause
// and window, summed per cause with the known ages only, newest first
// within the limit; a flush is a row of its own (cause flushed, 0 blocks);
// a BlockStored record is not a removal.
func TestRecordAndQuery(t *testing.T) {
	l := New(dbtest.NewPool(t), 0)
	ctx := context.Background()
	now := time.Now().Truncate(time.Millisecond)
	stored := removed(now, "acme", "")
	stored.Batch.Events[0].Kind = contract.BlockStored
	recs := []contract.KVEventRecord{
		removed(now.Add(-3*time.Hour), "acme", "evicted", 5000), // before the window
		removed(now.Add(-30*time.Minute), "acme", "evicted", 100, 300, -1),
		removed(now.Add(-20*time.Minute), "acme", "del", -1),
		removed(now.Add(-10*time.Minute), "globex", "evicted", 7),
		removed(now.Add(-5*time.Minute), "", "expired", 60),
		stored,
		cleared(now.Add(-time.Minute)),
	}
	if err := l.Record(ctx, recs); err != nil {
		t.Fatal(err)
	}
	acme, none := "acme", ""
	win := func(f Filter) Filter { f.Since, f.Until = now.Add(-time.Hour), now.Add(time.Second); return f }
	got, err := l.Query(ctx, win(Filter{Tenant: &acme, Limit: 10}))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.ByCause) != 2 || got.ByCause[0].Cause != "del" || got.ByCause[0].Blocks != 1 || got.ByCause[0].AgesKnown != 0 || got.ByCause[0].AgeAvgS != nil {
		t.Fatalf("acme by cause %+v, want del: 1 block of unknown age first", got.ByCause)
	}
	ev := got.ByCause[1]
	if ev.Cause != "evicted" || ev.Blocks != 3 || ev.AgesKnown != 2 || *ev.AgeMinS != 100 || *ev.AgeAvgS != 200 || *ev.AgeMaxS != 300 {
		t.Fatalf("acme evicted %+v, want 3 blocks, 2 ages 100..300 avg 200", ev)
	}
	if len(got.Recent) != 2 || got.Recent[0].Cause != "del" || got.Recent[1].Blocks != 3 || got.Recent[1].Tenant != "acme" {
		t.Fatalf("acme recent %+v, want the del then the eviction", got.Recent)
	}
	for _, tc := range []struct {
		name   string
		f      Filter
		blocks int64
		recent int
	}{
		{"every tenant", win(Filter{Limit: 10}), 6, 5},
		{"the tenant-less key space", win(Filter{Tenant: &none, Limit: 10}), 1, 2},
		{"one cause", win(Filter{Cause: "evicted", Limit: 1}), 4, 1},
		{"the flush", win(Filter{Cause: "flushed", Limit: 10}), 0, 1},
		{"no list", win(Filter{Limit: 0}), 6, 0},
		{"a wider window", Filter{Since: now.Add(-4 * time.Hour), Until: now.Add(time.Second), Limit: 10}, 7, 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := l.Query(ctx, tc.f)
			if err != nil {
				t.Fatal(err)
			}
			var blocks int64
			for _, c := range got.ByCause {
				blocks += c.Blocks
			}
			if blocks != tc.blocks || len(got.Recent) != tc.recent {
				t.Fatalf("%d blocks, %d recent; want %d, %d", blocks, len(got.Recent), tc.blocks, tc.recent)
			}
		})
	}
	if _, err := l.Query(ctx, Filter{Since: now, Until: now}); !errors.Is(err, ErrFilter) {
		t.Fatalf("empty window: %v, want ErrFilter", err)
	}
}

// TestPruneAfterRetention: Record deletes the rows older than the
// retention, at most once an hour.
func TestPruneAfterRetention(t *testing.T) {
	l := New(dbtest.NewPool(t), 2*time.Hour)
	ctx := context.Background()
	now := time.Now()
	l.now = func() time.Time { return now }
	if err := l.Record(ctx, []contract.KVEventRecord{removed(now.Add(-3*time.Hour), "a", "evicted", 1), removed(now.Add(-time.Hour), "a", "evicted", 1)}); err != nil {
		t.Fatal(err)
	}
	all := Filter{Since: now.Add(-24 * time.Hour), Until: now.Add(time.Second), Limit: 10}
	got, err := l.Query(ctx, all)
	if err != nil || len(got.Recent) != 1 {
		t.Fatalf("after the first record (which prunes): %d rows, %v; want the newer one", len(got.Recent), err)
	}
	if err := l.Record(ctx, []contract.KVEventRecord{removed(now.Add(-5*time.Hour), "a", "evicted", 1)}); err != nil {
		t.Fatal(err)
	}
	if got, _ := l.Query(ctx, all); len(got.Recent) != 2 {
		t.Fatalf("%d rows: a prune within the hour", len(got.Recent))
	}
	now = now.Add(pruneEvery)
	if err := l.Record(ctx, []contract.KVEventRecord{removed(now, "a", "evicted", 1)}); err != nil {
		t.Fatal(err)
	}
	all.Until = now.Add(time.Second)
	if got, _ := l.Query(ctx, all); len(got.Recent) != 1 {
		t.Fatalf("%d rows an hour later, want only the newest", len(got.Recent))
	}
}
