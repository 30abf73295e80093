package sim

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Report is the outcome of a run.
type Report struct {
	// RunTag prefixes the run's request ids.
	RunTag string `json:"run_tag"`
	// Model is the model name.
	Model string `json:"model"`
	// PD is set for a 1P1D run.
	PD bool `json:"pd"`
	// Parallel is the model's parallel layout, Layout its name ("TP8"),
	// WorldSize the worker ranks (gpuworkers) of every engine.
	Parallel  kvcore.Parallel `json:"parallel"`
	Layout    string          `json:"layout"`
	WorldSize int             `json:"world_size"`
	// Engines lists the engines played, in engine id order, each with its
	// figures; Total sums them.
	Engines []EngineSummary `json:"engines"`
	// Total sums the engines' figures.
	Total EngineCounts `json:"total"`
	// Workload is what was played.
	Workload Workload `json:"workload"`
	// ElapsedSeconds is the run's wall time.
	ElapsedSeconds float64 `json:"elapsed_seconds"`
	// Requests counts the user requests (turns).
	Requests RequestCounts `json:"requests"`
	// Preemptions counts preemptions over all engines.
	Preemptions int `json:"preemptions"`
	// Reuse describes what the engines did with blocks that saves in flight
	// still read when their request was preempted (Config.ReusePreempted),
	// and the blocks they declared evicted to their gpuworkers.
	Reuse ReuseCounts `json:"reuse"`
	// Tokens counts prompt tokens by where their KV came from.
	Tokens TokenCounts `json:"tokens"`
	// PrefixHitRate is the share of prompt tokens not computed: local
	// prefix-cache hits plus loaded tokens, over every admission's tokens.
	PrefixHitRate float64 `json:"prefix_hit_rate"`
	// Lookups describes the calls to the lookup service.
	Lookups LookupCounts `json:"lookups"`
	// TTFT is the time from a turn's arrival to its first token (the decode
	// engine's, in 1P1D): the time-to-first-token proxy.
	TTFT Percentiles `json:"ttft"`
	// Tenants lists, in a run with tenants (Workload.Tenants), each
	// tenant's admissions, hits and stored keys; absent without tenants.
	Tenants []TenantCounts `json:"tenants,omitempty"`
	// Verification is the byte-for-byte check of every loaded block.
	Verification Verification `json:"verification"`
	// Bytes counts the bytes moved.
	Bytes ByteCounts `json:"bytes"`
	// Ledger is the save ledger.
	Ledger LedgerReport `json:"ledger"`
	// Ranks describes every worker rank of every engine, engine by engine
	// in engine id order, ranks in Model.WorkerRanks order.
	Ranks []RankSummary `json:"ranks"`
	// SlowestRank is the rank with the most load time, when the gpuworkers
	// expose kvmesh_gpuworker_load_duration_seconds and loaded anything.
	SlowestRank *SlowestRank `json:"slowest_rank,omitempty"`
	// DeadRanks lists the ranks whose gpuworker stayed unreachable for the
	// rank timeout, in the order they died, with what that cost.
	DeadRanks []DeadRank `json:"dead_ranks"`
	// Trackers is the scheduler's view of the run (with Config.SchedulerURL).
	Trackers *TrackerCheck `json:"trackers,omitempty"`
	// DLQ is the sender's dead-letter queue for the run (with Config.SenderURL).
	DLQ *DLQCheck `json:"dlq,omitempty"`
	// Stored is the check of every value the run's saves stored (with
	// Config.RedisURL).
	Stored *StoreCheck `json:"stored_values,omitempty"`
	// OK is set when every request succeeded, no byte mismatched (loaded
	// or stored) or went unverified, no rank died, the ledger balanced and
	// the configured checks passed: the run's exit status.
	OK bool `json:"ok"`
}

// EngineSummary describes one engine of the run.
type EngineSummary struct {
	// ID is the engine id.
	ID string `json:"id"`
	// Role is what the engine did.
	Role Role `json:"role"`
	// PoolBlocks is the blocks per group its block manager handed out.
	PoolBlocks int `json:"pool_blocks"`
	// Partner is the other engine of its pair in a 1P1D run: a decode
	// engine's prefill engine, a prefill engine's decode engine.
	Partner string `json:"partner,omitempty"`
	// EngineCounts are the engine's figures.
	EngineCounts
	// Ledger is the save ledger of the engine's requests.
	Ledger EngineLedger `json:"ledger"`
}

// ReuseCounts describes preemption with block reuse and evictions.
type ReuseCounts struct {
	// ReusePreempted is set when preempted requests' blocks were freed at
	// once, even with saves in flight.
	ReusePreempted bool `json:"reuse_preempted"`
	// PreemptedWithSaves counts preemptions whose request had saves in
	// flight; SavesInFlight counts those saves.
	PreemptedWithSaves int `json:"preempted_with_saves_in_flight"`
	SavesInFlight      int `json:"saves_in_flight"`
	// ReusedWhileSaving counts blocks reused for other content while a save
	// reading them was not reported yet: the sender had to dead-letter it
	// (block_not_held) or store it from the right bytes.
	ReusedWhileSaving int `json:"blocks_reused_while_save_pending"`
	// EvictedBlocks counts the blocks declared evicted to the gpuworkers,
	// in EvictCalls calls; EvictedHeld those the workers reported holding
	// an identity; EvictFailures counts calls that failed.
	EvictedBlocks int `json:"evicted_blocks"`
	EvictedHeld   int `json:"evicted_held"`
	EvictCalls    int `json:"evict_calls"`
	EvictFailures int `json:"evict_failures"`
}

// RequestCounts counts the turns.
type RequestCounts struct {
	// Total is the workload's turns; OK and Failed split the finished ones
	// (a turn not finished counts as failed).
	Total  int `json:"total"`
	OK     int `json:"ok"`
	Failed int `json:"failed"`
	// FailedDeadRank counts the failed turns that failed because a rank
	// died (DeadRanks): a part of the turn needed the dead rank.
	FailedDeadRank int `json:"failed_dead_rank"`
	// Failures lists why engine requests failed (the first few).
	Failures []RequestFailure `json:"failures"`
}

// TokenCounts counts tokens.
type TokenCounts struct {
	// Prompt sums the tokens of every admission (a preempted request is
	// admitted again).
	Prompt int `json:"prompt"`
	// LocalHit are prompt tokens found in the engine's own prefix cache.
	LocalHit int `json:"local_hit"`
	// Loaded are external tokens loaded, by connector.
	Loaded map[string]int `json:"loaded"`
	// Computed are tokens the engines computed (prefill and decode).
	Computed int `json:"computed"`
	// Recomputed are loaded tokens recomputed after a load error, a lost
	// block or a mismatch.
	Recomputed int `json:"recomputed"`
}

// LookupCounts describes the lookups.
type LookupCounts struct {
	// Count is the lookups answered with a decision.
	Count int `json:"count"`
	// Retries counts lookups that failed (503 or unreachable) and were retried.
	Retries int `json:"retries"`
	// Pending counts "not yet" answers.
	Pending int `json:"pending"`
	// Anomalies counts decisions that did not fit the engine's state.
	Anomalies int `json:"anomalies"`
	// Latency is the answered lookups' latency.
	Latency Percentiles `json:"latency"`
}

// Verification is the byte check of loaded blocks.
type Verification struct {
	// Loads counts finished loads.
	Loads int `json:"loads"`
	// VerifiedBlocks counts loaded blocks read back and compared, once per
	// worker rank (each rank holds its own copy).
	VerifiedBlocks int `json:"verified_blocks"`
	// Mismatched counts block copies whose bytes were wrong.
	Mismatched int `json:"mismatched_blocks"`
	// RankUnavailable counts loaded block copies not verified because
	// their rank was dead: never counted as right.
	RankUnavailable int `json:"rank_unavailable_blocks"`
	// LoadErrorBlocks counts blocks reported as load errors (recomputed).
	LoadErrorBlocks int `json:"load_error_blocks"`
	// LostBlocks counts loaded blocks the gpuworker no longer held when
	// read back (lost KV, e.g. after a worker restart): recomputed, not
	// mismatched.
	LostBlocks int `json:"lost_blocks"`
	// Mismatches lists the first mismatched blocks.
	Mismatches []Mismatch `json:"mismatches"`
	// OK is set when no block mismatched and none went unverified.
	OK bool `json:"ok"`
}

// ByteCounts counts the bytes moved by the engines and the mesh.
type ByteCounts struct {
	// Computed is what the engines wrote into their pools, every rank's
	// copy counted.
	Computed int64 `json:"computed"`
	// ComputedHTTP is the part of Computed sent over the gpuworkers' data
	// plane write route; the rest the engines wrote straight into the KV
	// memory they registered with their gpuworkers (Config.KVMemory).
	ComputedHTTP int64 `json:"computed_http"`
	// Verified is what they read back to check loads, from every rank.
	Verified int64 `json:"verified"`
	// Saved is what the sender's results report stored.
	Saved int64 `json:"saved"`
	// Loaded is what the gpuworkers' load results report.
	Loaded int64 `json:"loaded"`
	// Total sums them; GiBPerSecond is Total over the run's wall time.
	Total        int64   `json:"total"`
	GiBPerSecond float64 `json:"gib_per_second"`
}

// report assembles the report once the run stopped (the engine goroutines
// have returned, so their state may be read).
func (r *run) report(elapsed time.Duration) *Report {
	st := r.stats
	st.mu.Lock()
	defer st.mu.Unlock()
	rep := &Report{
		RunTag: r.cfg.RunTag, Model: r.cfg.Model.Name, PD: r.cfg.PD, Workload: r.cfg.Workload,
		Parallel: r.cfg.Model.Parallel, Layout: LayoutText(r.cfg.Model), WorldSize: r.cfg.Model.WorldSize(),
		ElapsedSeconds: elapsed.Seconds(), Preemptions: st.preemptions,
		Reuse: ReuseCounts{ReusePreempted: r.cfg.ReusePreempted, PreemptedWithSaves: st.preemptedWithSaves,
			SavesInFlight: st.savesInFlightAtPreempt, ReusedWhileSaving: st.reusedWhileSaving,
			EvictedBlocks: st.evictedBlocks, EvictedHeld: st.evictedHeld, EvictCalls: st.evictCalls, EvictFailures: st.evictFailures},
		Tokens: TokenCounts{Prompt: st.promptTokens, LocalHit: st.localHitTokens, Loaded: maps.Clone(st.loadedTokens),
			Computed: st.computedTokens, Recomputed: st.recomputedTokens},
		PrefixHitRate: st.hitRateLocked(),
		Lookups: LookupCounts{Count: st.lookups, Retries: st.lookupRetries, Pending: st.lookupPending,
			Anomalies: st.lookupAnomalies, Latency: percentiles(st.lookupLatency)},
		TTFT: percentiles(st.ttft),
		Verification: Verification{Loads: st.loads, VerifiedBlocks: st.verifiedBlocks, Mismatched: st.mismatchedBlocks,
			RankUnavailable: st.unverifiedBlocks, LoadErrorBlocks: st.loadErrorBlocks, LostBlocks: st.lostBlocks,
			Mismatches: slices.Clone(st.mismatches), OK: st.mismatchedBlocks == 0 && st.unverifiedBlocks == 0},
		Ledger: r.ledger.report(),
	}
	rep.Tenants = st.tenantsLocked(r.ledger.storedByTenant())
	failures := slices.Clone(st.failures)
	partners := map[string]string{}
	for _, p := range r.pairs {
		if p.front != p.decode {
			partners[p.front.id], partners[p.decode.id] = p.decode.id, p.front.id
		}
	}
	ledgers := map[string]EngineLedger{}
	for _, l := range rep.Ledger.Engines {
		ledgers[l.EngineID] = l
	}
	for _, id := range slices.Sorted(maps.Keys(r.engines)) {
		e := r.engines[id]
		sum := EngineSummary{ID: e.id, Role: e.role, PoolBlocks: e.cfg.PoolBlocks, Partner: partners[id], Ledger: ledgers[id]}
		if c := st.engines[id]; c != nil {
			sum.EngineCounts = *c
		}
		sum.Ledger.EngineID, sum.Ledger.Balanced = id, sum.Ledger.Differences == 0
		rep.Total.add(sum.EngineCounts)
		rep.Engines = append(rep.Engines, sum)
		for _, req := range e.live {
			if len(failures) < maxListed {
				failures = append(failures, RequestFailure{EngineID: e.id, RequestID: req.id, Reason: "did not finish: " + req.phase.String()})
			}
		}
	}
	rep.Requests = RequestCounts{Total: st.requests, OK: st.done - st.failed, Failed: st.failed + st.requests - st.done, Failures: failures}
	r.rankReport(rep, st)
	rep.Bytes = ByteCounts{Computed: st.bytesWritten, ComputedHTTP: st.bytesWrittenHTTP, Verified: st.bytesRead, Saved: rep.Ledger.SaveBytes, Loaded: rep.Ledger.LoadBytes}
	rep.Bytes.Total = rep.Bytes.Computed + rep.Bytes.Verified + rep.Bytes.Saved + rep.Bytes.Loaded
	if elapsed > 0 {
		rep.Bytes.GiBPerSecond = float64(rep.Bytes.Total) / (1 << 30) / elapsed.Seconds()
	}
	rep.OK = rep.Requests.Failed == 0 && rep.Requests.OK == rep.Requests.Total && rep.Verification.OK && rep.Ledger.Balanced && len(rep.DeadRanks) == 0
	rep.emptyLists()
	return rep
}

// emptyLists makes empty lists [] rather than null in JSON.
func (rep *Report) emptyLists() {
	if rep.Requests.Failures == nil {
		rep.Requests.Failures = []RequestFailure{}
	}
	if rep.Verification.Mismatches == nil {
		rep.Verification.Mismatches = []Mismatch{}
	}
	if rep.Ledger.Differences == nil {
		rep.Ledger.Differences = []LedgerDifference{}
	}
	if rep.Ledger.MalformedTables == nil {
		rep.Ledger.MalformedTables = []string{}
	}
	if rep.Ledger.Engines == nil {
		rep.Ledger.Engines = []EngineLedger{}
	}
	if rep.Ledger.Ranks == nil {
		rep.Ledger.Ranks = []RankLedger{}
	}
	if rep.Ranks == nil {
		rep.Ranks = []RankSummary{}
	}
	if rep.DeadRanks == nil {
		rep.DeadRanks = []DeadRank{}
	}
}

func (p phase) String() string {
	switch p {
	case phaseWaiting:
		return "waiting"
	case phaseLoading:
		return "waiting for finished_recving"
	case phaseAllocated:
		return "allocated"
	case phaseRunning:
		return "running"
	case phaseFinishing:
		return "waiting for finished_sending"
	default:
		return "done"
	}
}

// WriteText writes the report as a table.
func (rep *Report) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k, format string, a ...any) { fmt.Fprintf(tw, "%s\t%s\n", k, fmt.Sprintf(format, a...)) }
	var engines []string
	for _, e := range rep.Engines {
		engines = append(engines, fmt.Sprintf("%s (%s, %d blocks/group)", e.ID, e.Role, e.PoolBlocks))
	}
	l := rep.Ledger
	row("run", "%s  model %s  %s%s  %.1f s", rep.RunTag, rep.Model, rep.shape(), rep.layoutText(), rep.ElapsedSeconds)
	row("engines", "%s", strings.Join(engines, ", "))
	row("requests", "%d total  %d ok  %d failed  (%d preemptions)", rep.Requests.Total, rep.Requests.OK, rep.Requests.Failed, rep.Preemptions)
	row("prefix hit rate", "%.1f%%  (local %d, loaded %s of %d prompt tokens)", 100*rep.PrefixHitRate, rep.Tokens.LocalHit, loadedText(rep.Tokens.Loaded), rep.Tokens.Prompt)
	row("preemption", "%s", rep.Reuse)
	row("tokens", "computed %d  recomputed after load errors %d", rep.Tokens.Computed, rep.Tokens.Recomputed)
	row("saves", "%d tasks: stored %d  existing %d  skipped %d  dead-lettered %d  failed %d (keys)", l.SaveTasks, l.Stored, l.Existing, l.Skipped, l.DeadLettered, l.Failed)
	row("bytes", "%s computed (%s of it over HTTP, the rest in shared KV memory), %s verified, %s saved, %s loaded: %.2f GiB/s", size(rep.Bytes.Computed), size(rep.Bytes.ComputedHTTP), size(rep.Bytes.Verified), size(rep.Bytes.Saved), size(rep.Bytes.Loaded), rep.Bytes.GiBPerSecond)
	row("lookup latency", "%s", rep.Lookups.Latency)
	row("TTFT proxy", "%s", rep.TTFT)
	v := rep.Verification
	row("verification", "%s: %d loads, %d %s, %d mismatched, %d load-error blocks recomputed, %d blocks lost (recomputed)%s",
		okText(v.OK), v.Loads, v.VerifiedBlocks, rep.checkedText(), v.Mismatched, v.LoadErrorBlocks, v.LostBlocks, unavailableText(v.RankUnavailable))
	row("save ledger", "%s: expected %d = stored %d + existing %d + skipped %d + dead-lettered %d  (+ failed %d); %d/%d tasks reported; engine expected %d saves",
		balancedText(l.Balanced), l.ExpectedChunks, l.Stored, l.Existing, l.Skipped, l.DeadLettered, l.Failed, l.Reported, l.SaveTasks, l.EngineExpectedSaves)
	if l.LoadTierBlocks > 0 {
		row("capacity tier", "%d of the loaded blocks read from the object tier (the rest from Redis)", l.LoadTierBlocks)
	}
	rep.writeRankRows(row)
	for _, tc := range rep.Tenants {
		row("tenant "+tc.Tenant, "%d admissions (%d first turns): %d prompt tokens, hit rate %.1f%% (local hit %d, store loaded %d, first turns %d), %d keys stored%s",
			tc.Admissions, tc.FirstTurnAdmissions, tc.PromptTokens, 100*tc.HitRate(), tc.LocalHitTokens, tc.StoreLoadedTokens, tc.FirstTurnStoreLoadedTokens, tc.StoredKeys, tc.Store.text())
	}
	if c := rep.Trackers; c != nil {
		row("scheduler", "%s: %d trackers of the run, %d not done, %d missing%s", okText(c.OK), c.Checked, len(c.NotDone), c.Missing, suffix(c.Error))
	}
	if c := rep.DLQ; c != nil {
		row("dead letters", "%s: %d entries for the run%s, %d dead-lettered saves not listed%s", okText(c.OK), c.Entries, reasonList(c.Reasons), len(c.Unlisted), suffix(c.Error))
	}
	if c := rep.Stored; c != nil {
		row("stored values", "%s: checked %d, wrong %d, gone %d (evicted; %d announced by BlockRemoved) of %d keys stored (%d announced, results report %d)%s",
			okText(c.OK), c.Checked, c.Wrong, c.Gone, c.GoneAnnounced, c.Keys, c.Announced, c.LedgerStored, suffix(c.Error))
	}
	row("result", "%s", okText(rep.OK))
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := rep.writeEngines(w); err != nil {
		return err
	}
	if err := rep.writeRanks(w); err != nil {
		return err
	}
	return rep.writeLists(w)
}

// shape describes the fleet: "single engine", "1P1D (pd,store)", or the
// number of decode engines (each with its prefill engine in 1P1D).
func (rep *Report) shape() string {
	decode := 0
	for _, e := range rep.Engines {
		if e.Role != RolePrefill {
			decode++
		}
	}
	switch {
	case decode <= 1 && rep.PD:
		return "1P1D (pd,store)"
	case decode <= 1:
		return "single engine"
	case rep.PD:
		return fmt.Sprintf("%d 1P1D pairs (pd,store)", decode)
	}
	return fmt.Sprintf("%d engines", decode)
}

// writeEngines writes the per-engine table and its total row.
func (rep *Report) writeEngines(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "engine\trole\trequests\tfailed\tpreempted\tprompt tokens\tlocal hit\tloaded\tcomputed\tsteps\trecords\tsave tasks\tstored\tledger\t")
	line := func(id, role string, c EngineCounts, l EngineLedger) {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t\n", id, role, c.Requests, c.Failed, c.Preemptions,
			c.PromptTokens, c.LocalHitTokens, c.LoadedTokens, c.ComputedTokens, c.Steps, c.StepRecords, l.SaveTasks, l.Stored, balancedText(l.Balanced))
	}
	for _, e := range rep.Engines {
		line(e.ID, string(e.Role), e.EngineCounts, e.Ledger)
	}
	l := rep.Ledger
	line("total", "", rep.Total, EngineLedger{LedgerCounts: l.LedgerCounts, Balanced: l.Balanced})
	return tw.Flush()
}

func (rep *Report) writeLists(w io.Writer) error {
	var b strings.Builder
	for _, f := range rep.Requests.Failures {
		fmt.Fprintf(&b, "  failed   %s %s: %s\n", f.EngineID, f.RequestID, f.Reason)
	}
	for _, m := range rep.Verification.Mismatches {
		fmt.Fprintf(&b, "  mismatch %s %s: group %d block %d chunk %s (loaded by %s)%s\n", m.EngineID, m.RequestID, m.Group, m.Block, m.Chunk, m.Connector, suffix(m.Rank))
	}
	if rep.Trackers != nil {
		for _, s := range first(rep.Trackers.NotDone) {
			fmt.Fprintf(&b, "  tracker  %s\n", s)
		}
	}
	if rep.Stored != nil {
		for _, v := range rep.Stored.Wrongs {
			fmt.Fprintf(&b, "  stored   %s: %s\n", v.Key, v.Problem)
		}
	}
	if rep.DLQ != nil {
		for _, s := range first(rep.DLQ.Unlisted) {
			fmt.Fprintf(&b, "  dlq      %s: dead-lettered keys reported, no entry in GET /v1/dlq\n", s)
		}
	}
	for i, d := range rep.Ledger.Differences {
		if i == maxListed {
			fmt.Fprintf(&b, "  ... %d more ledger differences\n", len(rep.Ledger.Differences)-maxListed)
			break
		}
		fmt.Fprintf(&b, "  ledger   %s %s %s: %s\n", d.EngineID, d.RequestID, d.TaskID, d.Problem)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// String writes the counts for the report's table.
func (c ReuseCounts) String() string {
	mode := "pinned until saved"
	if c.ReusePreempted {
		mode = "reused at once"
	}
	s := fmt.Sprintf("preempted blocks %s: preempted with saves in flight %d (%d saves), blocks reused while a save was pending %d; evicted %d blocks (%d held) in %d calls",
		mode, c.PreemptedWithSaves, c.SavesInFlight, c.ReusedWhileSaving, c.EvictedBlocks, c.EvictedHeld, c.EvictCalls)
	if c.EvictFailures > 0 {
		s += fmt.Sprintf(" (%d failed)", c.EvictFailures)
	}
	return s
}

func first(s []string) []string { return s[:min(len(s), maxListed)] }

func loadedText(m map[string]int) string {
	if len(m) == 0 {
		return "0"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func okText(ok bool) string {
	if ok {
		return "OK"
	}
	return "FAILED"
}

func balancedText(ok bool) string {
	if ok {
		return "balanced"
	}
	return "NOT BALANCED"
}

// size formats a byte count.
func size(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// suffix is " (text)" for a non-empty text, else "".
func suffix(text string) string {
	if text == "" {
		return ""
	}
	return " (" + text + ")"
}

// reasonList renders dead-letter counts by reason as " (reason n, …)", in
// reason order, or "" when there are none.
func reasonList(reasons map[string]int) string {
	if len(reasons) == 0 {
		return ""
	}
	keys := slices.Sorted(maps.Keys(reasons))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, reasons[k])
	}
	return " (" + strings.Join(parts, ", ") + ")"
}
