package sim

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

// rankRun is a finished run of one TP2 engine whose rank 1 died, with the
// per-rank figures set by hand.
func rankRun(t *testing.T, loadSeconds bool) *run {
	t.Helper()
	m := tpModel(t, 2)
	e := rankEngine(t, m, startMemWorkers(t, m, "decode-0"), time.Second)
	r := &run{cfg: Config{Model: m}, stats: e.stats, ledger: e.ledger, engines: map[string]*engine{e.id: e},
		pairs: []*pair{{front: e, decode: e}}, start: time.Now().Add(-10 * time.Second)}
	r.stats.requests, r.stats.done, r.stats.failed = 4, 4, 2
	r.stats.deadTurns["decode-0/tp1-pcp0-dcp0-pp0"] = 2
	r.stats.unverifiedBlocks = 3
	for k, rw := range e.ranks {
		rw.blocksWritten, rw.verified = 10+k, 5
		rw.before = workerMetrics{savePutBytes: 100, loadBytes: 1000, loadSeconds: 1, hasLoadSeconds: loadSeconds}
		rw.after = workerMetrics{savePutBytes: 300 + 100*float64(k), loadBytes: 5000, loadSeconds: 2 + 2*float64(k), hasLoadSeconds: loadSeconds}
	}
	dead := e.ranks[1]
	dead.dead, dead.deadAt = errors.New("write 3 blocks: connection refused"), r.start.Add(4*time.Second)
	dead.failedRequests, dead.unverified, dead.loadsMissing = 2, 3, 1
	return r
}

// TestReportPerRank: the report of a multi-rank run carries every rank's
// figures (metric deltas; none for a dead rank), the dead rank with what it
// cost, the failed turns it caused, and the slowest rank's share of its
// engine's load time; the run is not OK.
func TestReportPerRank(t *testing.T) {
	r := rankRun(t, true)
	rep := r.report(10 * time.Second)
	if rep.OK || rep.Layout != "TP2" || rep.WorldSize != 2 || len(rep.Ranks) != 2 || rep.Requests.FailedDeadRank != 2 || rep.Verification.OK {
		t.Fatalf("report %+v", rep)
	}
	live, dead := rep.Ranks[0], rep.Ranks[1]
	if live.SavedBytes != 200 || live.LoadedBytes != 4000 || live.LoadSeconds == nil || *live.LoadSeconds != 1 || live.Dead || live.BlocksWritten != 10 {
		t.Fatalf("live rank %+v", live)
	}
	if !dead.Dead || dead.SavedBytes != 0 || dead.LoadSeconds != nil || dead.MetricsError == "" || dead.RankUnavailable != 3 {
		t.Fatalf("dead rank %+v", dead)
	}
	d := rep.DeadRanks
	if len(d) != 1 || d[0].Name != "tp1-pcp0-dcp0-pp0" || d[0].FailedRequests != 2 || d[0].FailedTurns != 2 || d[0].UnverifiedBlocks != 3 ||
		d[0].LoadsMissing != 1 || d[0].AtSeconds < 3.9 || d[0].AtSeconds > 4.1 || !strings.Contains(d[0].Error, "connection refused") {
		t.Fatalf("dead ranks %+v", d)
	}
	if rep.SlowestRank != nil {
		t.Fatalf("slowest rank %+v of an engine whose dead rank has no load time", rep.SlowestRank)
	}
	var b strings.Builder
	if err := rep.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	for _, want := range []string{"TP2, 2 ranks per engine", "dead rank", "decode-0 tp1-pcp0-dcp0-pp0 (http://", "2 requests failed (2 turns), 3 block copies unverified",
		"3 block copies NOT verified (rank unavailable)", "rank ledger", "keys expected", "DEAD", "load s", "block copies checked on 2 ranks"} {
		if !strings.Contains(text, want) {
			t.Errorf("the text lacks %q:\n%s", want, text)
		}
	}
	js, err := json.Marshal(rep)
	if err != nil || !strings.Contains(string(js), `"dead_ranks":[{"engine_id":"decode-0"`) || !strings.Contains(string(js), `"failed_dead_rank":2`) {
		t.Fatalf("JSON %s (%v)", js, err)
	}
}

// TestReportSlowestRank: with every rank's load time known, the slowest
// rank line gives its seconds and share against a balanced engine's.
func TestReportSlowestRank(t *testing.T) {
	r := rankRun(t, true)
	rw := r.engines["decode-0"].ranks[1]
	rw.dead = nil
	rep := r.report(10 * time.Second)
	s := rep.SlowestRank
	// rank 0 loaded for 1 s, rank 1 for 3 s.
	if s == nil || s.Name != "tp1-pcp0-dcp0-pp0" || s.Seconds != 3 || s.SharePercent != 75 || s.BalancedPercent != 50 {
		t.Fatalf("slowest rank %+v", s)
	}
	var b strings.Builder
	if err := rep.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	if want := "\nslowest rank: decode-0 tp1-pcp0-dcp0-pp0 3.000 s of load time, 75.0% of the engine's total (balanced: 50.0%)\n"; !strings.Contains(b.String(), want) {
		t.Fatalf("text lacks %q:\n%s", want, b.String())
	}
	r = rankRun(t, false)
	r.engines["decode-0"].ranks[1].dead = nil
	rep = r.report(10 * time.Second)
	b.Reset()
	_ = rep.WriteText(&b)
	if rep.SlowestRank != nil || strings.Contains(b.String(), "load s") || strings.Contains(b.String(), "slowest rank") {
		t.Fatalf("without the load histogram: slowest %+v, text:\n%s", rep.SlowestRank, b.String())
	}
}

// TestReportSingleRank: a single-rank run's text has no layout, rank
// table or rank rows: it reads as before.
func TestReportSingleRank(t *testing.T) {
	m := tpModel(t, 1)
	e := rankEngine(t, m, startMemWorkers(t, m, "e"), time.Second)
	r := &run{cfg: Config{Model: m}, stats: e.stats, ledger: e.ledger, engines: map[string]*engine{e.id: e}, pairs: []*pair{{front: e, decode: e}}, start: time.Now()}
	rep := r.report(time.Second)
	var b strings.Builder
	if err := rep.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	for _, not := range []string{"ranks per engine", "rank ledger", "keys expected", "slowest rank", "dead rank", "copies"} {
		if strings.Contains(b.String(), not) {
			t.Errorf("a TP1 report says %q:\n%s", not, b.String())
		}
	}
	if len(rep.Ranks) != 1 || rep.Layout != "TP1" || rep.WorldSize != 1 {
		t.Fatalf("ranks %+v, layout %q", rep.Ranks, rep.Layout)
	}
}
