package app_test

import (
	"bufio"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// specTP2 is specFullMamba at tensor parallel 2: one gpuworker per rank,
// each reporting every load.
const specTP2 = specFullMamba + `parallel:
  tp: 2
`

// rankLoad issues an accepted 32-token store load into table(0, 3) and
// checks it names both ranks. Its blocks are 0 and 1 (full attention)
// and 101 (the Mamba state at 32).
func rankLoad(t *testing.T, h *mesh) (*request, kvcore.LoadTask) {
	t.Helper()
	r, l := acceptedLoad(t, h, kvcore.LoadSpec{KVPoolCachedTokens: 32}, table(0, 3))
	if !slices.Equal(l.Ranks, []kvcore.Rank{{TP: 0}, {TP: 1}}) {
		t.Fatalf("load ranks %v, want tp0 and tp1", l.Ranks)
	}
	return r, l
}

// rankResult produces rank's load result for task and waits until the
// scheduler applied it and published what it emitted.
func (r *request) rankResult(task kvcore.LoadTask, rank kvcore.Rank, errs ...kvcore.BlockID) {
	r.h.t.Helper()
	res := r.transferResult(contract.TransferResult{Kind: contract.TransferLoad, TaskID: task.TaskID, Status: "done",
		Rank: &rank, LoadErrors: errs})
	r.h.produce(contract.TopicTransferResults, keyed{r.id, res})
	eventually(r.h.t, "result "+res.ResultID+" applied", func() bool {
		var n int
		err := r.h.pool.QueryRow(r.h.ctx, `SELECT count(*) FROM processed_records
			WHERE kind = 'result' AND engine_id = $1 AND request_id = $2 AND id = $3`, r.engine, r.id, res.ResultID).Scan(&n)
		return err == nil && n == 1
	})
	r.settled()
}

// recving returns the request's finished_recving messages.
func (r *request) recving() []contract.EngineFeedback {
	var out []contract.EngineFeedback
	for _, f := range r.feedback() {
		if f.Kind == kvcore.FeedbackFinishedRecving {
			out = append(out, f)
		}
	}
	return out
}

// TestMultiRankLoad: a TP2 load yields finished_recving only once both
// ranks reported, with the union of their load errors; a repeated report
// of a rank changes nothing.
func TestMultiRankLoad(t *testing.T) {
	h := newMesh(t, meshOptions{spec: specTP2})
	r, l := rankLoad(t, h)
	r.rankResult(l, kvcore.Rank{TP: 0}, 0)
	if f := r.feedback(); len(f) != 0 {
		t.Fatalf("after rank 0 of 2: feedback %+v, want none", f)
	}
	r.rankResult(l, kvcore.Rank{TP: 0}, 1)
	if f := r.feedback(); len(f) != 0 {
		t.Fatalf("after rank 0 again: feedback %+v, want none", f)
	}
	if d := r.settled(); len(d.Tasks) != 1 {
		t.Fatalf("outstanding tasks %+v, want the load until its last rank", d.Tasks)
	}
	r.rankResult(l, kvcore.Rank{TP: 1}, 101)
	f := r.recving()
	if len(f) != 1 || f[0].TaskID != l.TaskID || !slices.Equal(f[0].LoadErrors, []kvcore.BlockID{0, 101}) || len(f[0].MissingRanks) != 0 {
		t.Fatalf("after both ranks: finished_recving %+v, want one with load errors [0 101]", f)
	}
	if d := r.settled(); len(d.Tasks) != 0 {
		t.Fatalf("outstanding tasks %+v after the last rank", d.Tasks)
	}
}

// TestSilentRankExpires: rank 1 never reports; an expiry round past
// KVMESH_LOAD_RANK_TIMEOUT finishes the load fail-closed, once: every
// block in load_errors, rank 1 in missing_ranks. Expiring again finds
// nothing, and rank 1's late result changes nothing. The round is run
// directly (the timeout is an hour) so that rank 0's result is applied
// before it, however slow the machine; TestExpiryLoop covers the timer.
func TestSilentRankExpires(t *testing.T) {
	h := newMesh(t, meshOptions{spec: specTP2, config: func(c *app.Config) { c.LoadRankTimeout = time.Hour }})
	r, l := rankLoad(t, h)
	r.rankResult(l, kvcore.Rank{TP: 0}, 0)
	if n, err := h.app.ExpireLoads(h.ctx, time.Now().Add(30*time.Minute)); err != nil || n != 0 {
		t.Fatalf("expiring before the deadline: %d overdue, %v; want none", n, err)
	}
	if n, err := h.app.ExpireLoads(h.ctx, time.Now().Add(2*time.Hour)); err != nil || n != 1 {
		t.Fatalf("expiring past the deadline: %d overdue, %v; want the load", n, err)
	}
	r.settled()
	f := r.recving()
	if len(f) != 1 || f[0].TaskID != l.TaskID || !slices.Equal(f[0].LoadErrors, []kvcore.BlockID{0, 1, 101}) ||
		!slices.Equal(f[0].MissingRanks, []kvcore.Rank{{TP: 1}}) {
		t.Fatalf("finished_recving %+v, want one with every block [0 1 101] and missing rank tp1", f)
	}
	if keys := h.out.keys(contract.TopicEngineFeedback, r.id); len(keys) != 1 || keys[0] != r.engine {
		t.Fatalf("feedback keys %v, want the engine id", keys)
	}
	var deadline *time.Time
	if err := h.pool.QueryRow(h.ctx, `SELECT load_deadline FROM trackers WHERE engine_id = $1 AND request_id = $2`,
		r.engine, r.id).Scan(&deadline); err != nil || deadline != nil {
		t.Fatalf("load_deadline %v, %v after the expiry; want NULL", deadline, err)
	}
	if n, err := h.app.ExpireLoads(h.ctx, time.Now().Add(3*time.Hour)); err != nil || n != 0 {
		t.Fatalf("expiring again: %d overdue, %v; want none", n, err)
	}
	if got := expiredMetric(t, h); got != "1" {
		t.Fatalf("kvmesh_scheduler_load_ranks_expired_total{connector=\"store\"} = %q, want 1", got)
	}
	r.rankResult(l, kvcore.Rank{TP: 1})
	d := r.settled()
	if n := len(r.feedback()); n != 1 || h.outboxCount(contract.TopicEngineFeedback, r.id) != 1 {
		t.Fatalf("after the late result: %d feedback messages, want still 1", n)
	}
	if len(d.Tasks) != 0 || len(d.Errors) == 0 {
		t.Fatalf("detail tasks %+v errors %+v; want no task and the expiry's warning", d.Tasks, d.Errors)
	}
}

// TestExpiryLoop: with KVMESH_LOAD_RANK_TIMEOUT at 200ms and no rank
// reporting, the maintenance loop on its own finishes the load, no
// earlier than the timeout, with every block in error and both ranks
// missing.
func TestExpiryLoop(t *testing.T) {
	h := newMesh(t, meshOptions{spec: specTP2, config: func(c *app.Config) { c.LoadRankTimeout = 200 * time.Millisecond }})
	issued := time.Now() // before the load is stored with its deadline
	r, l := rankLoad(t, h)
	eventually(t, "the expiry's finished_recving", func() bool {
		r.h.out.sync(t)
		return len(r.recving()) > 0
	})
	if waited := time.Since(issued); waited < 200*time.Millisecond {
		t.Fatalf("expired after %s, before the 200ms timeout", waited)
	}
	r.settled()
	f := r.recving()
	if len(f) != 1 || f[0].TaskID != l.TaskID || !slices.Equal(f[0].LoadErrors, []kvcore.BlockID{0, 1, 101}) ||
		!slices.Equal(f[0].MissingRanks, []kvcore.Rank{{TP: 0}, {TP: 1}}) {
		t.Fatalf("finished_recving %+v, want one with every block [0 1 101] and both ranks missing", f)
	}
	if got := expiredMetric(t, h); got != "2" {
		t.Fatalf("kvmesh_scheduler_load_ranks_expired_total{connector=\"store\"} = %q, want 2 (one per silent rank)", got)
	}
}

// expiredMetric scrapes the store connector's expired-ranks counter.
func expiredMetric(t *testing.T, h *mesh) string {
	t.Helper()
	resp, err := http.Get("http://" + h.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	want := fmt.Sprintf("kvmesh_scheduler_load_ranks_expired_total{connector=%q} ", "store")
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), want); ok {
			return v
		}
	}
	return ""
}
