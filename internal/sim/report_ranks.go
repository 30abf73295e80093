package sim

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// RankSummary describes one worker rank of one engine: its gpuworker and
// what moved through it.
type RankSummary struct {
	// EngineID is the engine; Rank the worker rank, Name its label
	// (tp3-pcp0-dcp0-pp0); URL its gpuworker.
	EngineID string      `json:"engine_id"`
	Rank     kvcore.Rank `json:"rank"`
	Name     string      `json:"name"`
	URL      string      `json:"url"`
	// BlocksWritten counts the blocks the engine wrote into the rank's
	// pool (computed or recomputed), BytesWritten their bytes.
	BlocksWritten int   `json:"blocks_written"`
	BytesWritten  int64 `json:"bytes_written"`
	// KVMemory is how they reached the rank's gpuworker: "shm" (straight
	// into the KV memory the engine registered with it) or "http" (the
	// data plane's write route).
	KVMemory string `json:"kv_memory"`
	// SavedBytes is what the rank's gpuworker put into the store over the
	// run (the delta of kvmesh_store_bytes_total{op="save_put"}), and
	// LoadedBytes what loads wrote into its pool (the delta of
	// kvmesh_gpuworker_load_bytes_total); both 0 when MetricsError is set.
	SavedBytes  int64 `json:"saved_bytes"`
	LoadedBytes int64 `json:"loaded_bytes"`
	// LoadSeconds is the rank's load time over the run (the delta of
	// kvmesh_gpuworker_load_duration_seconds_sum), absent when the worker
	// does not expose the histogram or MetricsError is set.
	LoadSeconds *float64 `json:"load_seconds,omitempty"`
	// MetricsError says why the metric figures are missing (a failed
	// scrape of /metrics, or a dead rank).
	MetricsError string `json:"metrics_error,omitempty"`
	// VerifiedBlocks counts the loaded blocks read back from the rank and
	// compared, MismatchedBlocks those whose bytes were wrong, LostBlocks
	// those it no longer held, and RankUnavailable those not verified
	// because the rank was dead.
	VerifiedBlocks   int `json:"verified_blocks"`
	MismatchedBlocks int `json:"mismatched_blocks"`
	LostBlocks       int `json:"lost_blocks"`
	RankUnavailable  int `json:"rank_unavailable_blocks"`
	// LoadsMissing counts the engine's loads the scheduler finished
	// without this rank's report (feedback missing_ranks).
	LoadsMissing int `json:"loads_missing"`
	// ExpectedKeys and StoredKeys are the rank's save ledger
	// (LedgerReport.Ranks).
	ExpectedKeys int `json:"expected_keys"`
	StoredKeys   int `json:"stored_keys"`
	// Dead is set when the rank died during the run (DeadRanks).
	Dead bool `json:"dead"`
}

// DeadRank is a rank whose gpuworker stayed unreachable for the rank
// timeout, and what its death cost.
type DeadRank struct {
	// EngineID, Rank, Name and URL name the rank and its gpuworker.
	EngineID string      `json:"engine_id"`
	Rank     kvcore.Rank `json:"rank"`
	Name     string      `json:"name"`
	URL      string      `json:"url"`
	// AtSeconds is when, from the start of the run, it was found dead.
	AtSeconds float64 `json:"at_seconds"`
	// Error is the call that kept failing.
	Error string `json:"error"`
	// FailedRequests counts the engine's requests failed because of it
	// (each failure's dead_rank names it); FailedTurns the turns that
	// failed because of it, its engine's part or the partner's (a decode
	// part whose prefill part failed on it).
	FailedRequests int `json:"failed_requests"`
	FailedTurns    int `json:"failed_turns"`
	// UnverifiedBlocks counts the loaded blocks not verified on it.
	UnverifiedBlocks int `json:"unverified_blocks"`
	// LoadsMissing counts the loads the scheduler finished without its
	// report.
	LoadsMissing int `json:"loads_missing"`
}

// SlowestRank is the rank that spent the most time loading.
type SlowestRank struct {
	// EngineID and Name name the rank.
	EngineID string `json:"engine_id"`
	Name     string `json:"name"`
	// Seconds is its load time; SharePercent its share of its engine's
	// load time over all ranks, BalancedPercent the share of a perfectly
	// balanced engine (100 / world size).
	Seconds         float64 `json:"seconds"`
	SharePercent    float64 `json:"share_percent"`
	BalancedPercent float64 `json:"balanced_percent"`
}

// rankReport fills in the per-rank figures, the dead ranks and the
// slowest rank; st.mu is held.
func (r *run) rankReport(rep *Report, st *stats) {
	ledgers := map[string]RankLedger{}
	for _, l := range rep.Ledger.Ranks {
		ledgers[l.EngineID+"/"+l.Name] = l
	}
	var dead []*rankWorker
	deadEngine := map[*rankWorker]string{}
	for _, id := range slices.Sorted(maps.Keys(r.engines)) {
		for _, rw := range r.engines[id].ranks {
			rep.Ranks = append(rep.Ranks, rankSummary(id, rw, ledgers[id+"/"+rw.label()]))
			if rw.dead != nil {
				dead = append(dead, rw)
				deadEngine[rw] = id
			}
		}
	}
	slices.SortStableFunc(dead, func(a, b *rankWorker) int { return a.deadAt.Compare(b.deadAt) })
	for _, rw := range dead {
		id := deadEngine[rw]
		rep.DeadRanks = append(rep.DeadRanks, DeadRank{
			EngineID: id, Rank: rw.rank, Name: rw.label(), URL: rw.url, AtSeconds: rw.deadAt.Sub(r.start).Seconds(),
			Error: rw.dead.Error(), FailedRequests: rw.failedRequests, FailedTurns: st.deadTurns[id+"/"+rw.label()],
			UnverifiedBlocks: rw.unverified, LoadsMissing: rw.loadsMissing,
		})
	}
	for _, n := range st.deadTurns {
		rep.Requests.FailedDeadRank += n
	}
	rep.SlowestRank = slowestRank(rep.Ranks)
}

// rankSummary describes one rank of engine id.
func rankSummary(id string, rw *rankWorker, l RankLedger) RankSummary {
	s := RankSummary{
		EngineID: id, Rank: rw.rank, Name: rw.label(), URL: rw.url, BlocksWritten: rw.blocksWritten, BytesWritten: rw.bytesWritten,
		VerifiedBlocks: rw.verified, MismatchedBlocks: rw.mismatched, LostBlocks: rw.lost, RankUnavailable: rw.unverified,
		LoadsMissing: rw.loadsMissing, ExpectedKeys: l.ExpectedKeys, StoredKeys: l.StoredKeys, Dead: rw.dead != nil,
		KVMemory: KVMemoryHTTP,
	}
	if rw.mem != nil {
		s.KVMemory = KVMemoryShm
	}
	switch {
	case rw.metricsErr != nil:
		s.MetricsError = rw.metricsErr.Error()
	case rw.dead != nil:
		s.MetricsError = "rank dead: no metrics after the run"
	default:
		s.SavedBytes = int64(rw.after.savePutBytes - rw.before.savePutBytes)
		s.LoadedBytes = int64(rw.after.loadBytes - rw.before.loadBytes)
		if rw.before.hasLoadSeconds && rw.after.hasLoadSeconds {
			sec := rw.after.loadSeconds - rw.before.loadSeconds
			s.LoadSeconds = &sec
		}
	}
	return s
}

// slowestRank is the rank with the most load time, among engines whose
// every rank reports load time; nil when none loaded anything.
func slowestRank(ranks []RankSummary) *SlowestRank {
	total, complete, count := map[string]float64{}, map[string]bool{}, map[string]int{}
	for _, s := range ranks {
		if _, seen := complete[s.EngineID]; !seen {
			complete[s.EngineID] = true
		}
		count[s.EngineID]++
		if s.LoadSeconds == nil {
			complete[s.EngineID] = false
			continue
		}
		total[s.EngineID] += *s.LoadSeconds
	}
	var best *SlowestRank
	for _, s := range ranks {
		if !complete[s.EngineID] || total[s.EngineID] <= 0 || best != nil && *s.LoadSeconds <= best.Seconds {
			continue
		}
		best = &SlowestRank{EngineID: s.EngineID, Name: s.Name, Seconds: *s.LoadSeconds,
			SharePercent: 100 * *s.LoadSeconds / total[s.EngineID], BalancedPercent: 100 / float64(count[s.EngineID])}
	}
	return best
}

// layoutText is the run line's parallel layout, "  TP8, 8 ranks per
// engine"; empty for single-rank engines, whose report stays as it was.
func (rep *Report) layoutText() string {
	if rep.WorldSize <= 1 {
		return ""
	}
	return fmt.Sprintf("  %s, %d ranks per engine", rep.Layout, rep.WorldSize)
}

// checkedText names what verification counts: blocks, or with several
// ranks block copies (one per rank).
func (rep *Report) checkedText() string {
	if rep.WorldSize <= 1 {
		return "blocks checked"
	}
	return fmt.Sprintf("block copies checked on %d ranks each", rep.WorldSize)
}

func unavailableText(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(", %d block copies NOT verified (rank unavailable)", n)
}

// writeRankRows adds the per-rank rows of the report's summary: the rank
// ledger (multi-rank engines) and the dead ranks.
func (rep *Report) writeRankRows(row func(k, format string, a ...any)) {
	l := rep.Ledger
	if rep.WorldSize > 1 {
		lo, hi := spread(l.Ranks, func(r RankLedger) int { return r.ExpectedKeys })
		slo, shi := spread(l.Ranks, func(r RankLedger) int { return r.StoredKeys })
		row("rank ledger", "%s per rank: %d ranks, expected %s keys each, stored %s; %d stored keys written by no rank",
			balancedText(l.RanksBalanced), len(l.Ranks), rangeText(lo, hi), rangeText(slo, shi), l.RanksUnattributed)
	}
	for _, d := range rep.DeadRanks {
		row("dead rank", "%s %s (%s) at %.1f s: %d requests failed (%d turns), %d block copies unverified, %d loads finished without it: %s",
			d.EngineID, d.Name, d.URL, d.AtSeconds, d.FailedRequests, d.FailedTurns, d.UnverifiedBlocks, d.LoadsMissing, d.Error)
	}
}

func spread[T any](items []T, f func(T) int) (lo, hi int) {
	for i, it := range items {
		v := f(it)
		if i == 0 || v < lo {
			lo = v
		}
		hi = max(hi, v)
	}
	return lo, hi
}

func rangeText(lo, hi int) string {
	if lo == hi {
		return fmt.Sprint(lo)
	}
	return fmt.Sprintf("%d-%d", lo, hi)
}

// writeRanks writes the per-rank table of multi-rank engines and the
// slowest rank's line (nothing for single-rank engines: the engine table
// says it all).
func (rep *Report) writeRanks(w io.Writer) error {
	if rep.WorldSize <= 1 {
		return nil
	}
	seconds := slices.ContainsFunc(rep.Ranks, func(s RankSummary) bool { return s.LoadSeconds != nil })
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := []string{"engine", "rank", "blocks written", "saved", "loaded"}
	if seconds {
		head = append(head, "load s")
	}
	head = append(head, "verified", "mismatched", "keys expected", "keys stored", "state")
	fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
	for _, s := range rep.Ranks {
		cells := []string{s.EngineID, s.Name, fmt.Sprint(s.BlocksWritten), size(s.SavedBytes), size(s.LoadedBytes)}
		if seconds {
			cells = append(cells, secondsText(s.LoadSeconds))
		}
		cells = append(cells, fmt.Sprint(s.VerifiedBlocks), fmt.Sprint(s.MismatchedBlocks), fmt.Sprint(s.ExpectedKeys), fmt.Sprint(s.StoredKeys), rankState(s))
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if s := rep.SlowestRank; s != nil {
		_, err := fmt.Fprintf(w, "slowest rank: %s %s %.3f s of load time, %.1f%% of the engine's total (balanced: %.1f%%)\n",
			s.EngineID, s.Name, s.Seconds, s.SharePercent, s.BalancedPercent)
		return err
	}
	return nil
}

func secondsText(s *float64) string {
	if s == nil {
		return "-"
	}
	return fmt.Sprintf("%.3f", *s)
}

func rankState(s RankSummary) string {
	switch {
	case s.Dead:
		return "DEAD"
	case s.MetricsError != "":
		return "no metrics"
	}
	return "ok"
}
