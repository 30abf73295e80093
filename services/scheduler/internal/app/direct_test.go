package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// TestPublishOnCommit: the scheduler publishes its save tasks itself
// right after their transaction commits (the rows carry its lease, and
// end sent), unless KVMESH_OUTBOX_PUBLISH_ON_COMMIT_DISABLED leaves them to
// the relay (no lease); either way each task reaches the topic once.
func TestPublishOnCommit(t *testing.T) {
	for _, c := range []struct {
		name   string
		off    bool
		leased bool
	}{
		{"on", false, true},
		{"off", true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			h := newMesh(t, meshOptions{config: func(cfg *app.Config) { cfg.NoPublishOnCommit = c.off }})
			r := h.request("direct")
			r.admit(48)
			r.allocate(0, table(0, 3), "")
			r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
			if s := r.waitSaves(1); s[0].End != 48 {
				t.Fatalf("save task %+v, want [0,48)", s[0])
			}
			var rows, leased, unsent int
			eventually(t, "the save row marked sent", func() bool {
				err := h.pool.QueryRow(h.ctx, `SELECT count(*), count(publish_owner), count(*) FILTER (WHERE sent_at IS NULL)
					FROM outbox WHERE topic = $1`, contract.TopicSaveTasks).Scan(&rows, &leased, &unsent)
				if err != nil {
					t.Fatal(err)
				}
				return unsent == 0
			})
			if rows != 1 || (leased == 1) != c.leased {
				t.Fatalf("%d save rows, %d of them leased to the scheduler; want 1, leased %v", rows, leased, c.leased)
			}
			h.out.sync(t)
			if s := r.saves(); len(s) != 1 {
				t.Fatalf("%d save tasks on the topic, want 1", len(s))
			}
		})
	}
}
