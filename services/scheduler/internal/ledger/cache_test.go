package ledger_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// The ledger keeps each applied request decoded with its row's version: a
// later apply reads and decodes nothing while the row is unchanged, and
// sees every other write of the row (another replica's, an operator's)
// and never a rolled-back change.
func TestCachedRequestFollowsTheRow(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := model(t)
	l := ledger.New(pool, m)
	ctx := context.Background()
	rec := func(id string) ledger.Record {
		return ledger.Record{Kind: ledger.KindStep, ID: id, EngineID: "e1", RequestID: "r1"}
	}
	seen := func(id string) (last int64, warnings int) {
		t.Helper()
		_, err := l.Apply(ctx, rec(id), func(req *requeststate.Request) ([]bus.Message, error) {
			last, warnings = req.LastSeq, len(req.Extras.Warnings)
			return nil, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return last, warnings
	}
	if _, err := admit(l, m, "r1", "ev1", 1); err != nil {
		t.Fatal(err)
	}
	if last, _ := seen("a"); last != 1 {
		t.Fatalf("last seq %d, want 1", last)
	}
	// A rolled-back change is not seen.
	boom := errors.New("boom")
	_, err := l.Apply(ctx, rec("b"), func(req *requeststate.Request) ([]bus.Message, error) {
		req.LastSeq = 40
		return nil, boom
	})
	if !errors.Is(err, boom) {
		t.Fatal(err)
	}
	if last, _ := seen("c"); last != 1 {
		t.Fatalf("last seq %d after a rollback, want 1", last)
	}
	// Another writer's change is seen: the row moved to another version.
	if _, err := pool.Exec(ctx, `UPDATE trackers SET last_seq = 7,
		extras = jsonb_set(extras, '{warnings}', '[{"source": "x", "error": "from elsewhere"}]') WHERE request_id = 'r1'`); err != nil {
		t.Fatal(err)
	}
	if last, w := seen("d"); last != 7 || w != 1 {
		t.Fatalf("last seq %d, %d warnings after another writer's update, want 7 and 1", last, w)
	}
	// The ledger's own change is seen from its cache.
	if _, err := l.Apply(ctx, rec("e"), func(req *requeststate.Request) ([]bus.Message, error) {
		req.LastSeq = 9
		return nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	if last, _ := seen("f"); last != 9 {
		t.Fatalf("last seq %d, want 9", last)
	}
	// And by a fresh ledger (another replica) from the row.
	if last, _ := func() (int64, int) { l = ledger.New(pool, m); return seen("g") }(); last != 9 {
		t.Fatalf("another ledger reads last seq %d, want 9", last)
	}
}
