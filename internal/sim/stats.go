package sim

import (
	"fmt"
	"slices"
	"sync"
	"time"
)

// maxListed bounds the failures and mismatches a report lists one by one.
const maxListed = 50

// stats are the counters the engines update while they run. Safe for
// concurrent use.
type stats struct {
	mu sync.Mutex

	requests, done, failed int // turns: total, finalized, finalized with a failure
	failures               []RequestFailure
	preemptions            int
	// preemptedWithSaves counts preemptions whose request had saves in
	// flight (reusePreempted), savesInFlightAtPreempt those saves, and
	// reusedWhileSaving the blocks reused for other content while such a
	// save was not reported yet.
	preemptedWithSaves, savesInFlightAtPreempt, reusedWhileSaving int
	evictCalls, evictedBlocks, evictedHeld, evictFailures         int

	promptTokens, localHitTokens, computedTokens, recomputedTokens int
	loadedTokens                                                   map[string]int // by connector
	loads, loadErrorBlocks, lostBlocks                             int

	lookups, lookupRetries, lookupPending, lookupAnomalies int
	lookupLatency, ttft                                    []time.Duration

	// verifiedBlocks counts loaded block copies compared (one per rank),
	// unverifiedBlocks those a dead rank could not be asked for.
	verifiedBlocks, mismatchedBlocks, unverifiedBlocks int
	mismatches                                         []Mismatch
	// deadTurns counts the turns failed because of each dead rank
	// (engine/rank); deadRanks counts the dead ranks.
	deadTurns               map[string]int
	deadRanks               int
	bytesWritten, bytesRead int64
	// bytesWrittenHTTP is the part of bytesWritten sent over the data
	// plane's write route (the rest went straight into KV memory).
	bytesWrittenHTTP int64

	engines map[string]*EngineCounts // by engine id
	tenants map[string]*TenantCounts // by tenant (runs with tenants)
}

// EngineCounts are one engine's figures of a run (the report's per-engine
// table; its total row sums them).
type EngineCounts struct {
	// Requests counts the engine requests finalized on the engine (a turn
	// is one request per engine that serves it), Failed those that failed.
	Requests int `json:"requests"`
	Failed   int `json:"failed"`
	// Preemptions counts the engine's preemptions.
	Preemptions int `json:"preemptions"`
	// PromptTokens sums the tokens of the engine's admissions; LocalHit
	// those found in its own prefix cache, Loaded those loaded (any
	// connector), Computed the tokens it computed (prefill and decode).
	PromptTokens   int `json:"prompt_tokens"`
	LocalHitTokens int `json:"local_hit_tokens"`
	LoadedTokens   int `json:"loaded_tokens"`
	ComputedTokens int `json:"computed_tokens"`
	// Steps counts the engine's published steps, StepRecords the engine
	// step records they took (a step splits over several past
	// contract.MaxStepRequests events or about 768 KiB), Events the request
	// events they carried.
	Steps       int `json:"steps"`
	StepRecords int `json:"step_records"`
	Events      int `json:"events"`
}

// add sums o into c.
func (c *EngineCounts) add(o EngineCounts) {
	c.Requests += o.Requests
	c.Failed += o.Failed
	c.Preemptions += o.Preemptions
	c.PromptTokens += o.PromptTokens
	c.LocalHitTokens += o.LocalHitTokens
	c.LoadedTokens += o.LoadedTokens
	c.ComputedTokens += o.ComputedTokens
	c.Steps += o.Steps
	c.StepRecords += o.StepRecords
	c.Events += o.Events
}

// RequestFailure is one request that did not complete cleanly.
type RequestFailure struct {
	// EngineID is the engine that served the request.
	EngineID string `json:"engine_id"`
	// RequestID is the request.
	RequestID string `json:"request_id"`
	// Reason says what went wrong.
	Reason string `json:"reason"`
	// DeadRank names the engine and rank ("decode-0/tp3-pcp0-dcp0-pp0")
	// whose dead gpuworker failed the request, when one did.
	DeadRank string `json:"dead_rank,omitempty"`
}

// Mismatch is one loaded block whose bytes were not what its hash implies.
type Mismatch struct {
	// EngineID is the engine whose pool holds the block.
	EngineID string `json:"engine_id"`
	// RequestID is the request that loaded it.
	RequestID string `json:"request_id"`
	// Group is the KV group.
	Group int `json:"group"`
	// Block is the block id in the group's pool.
	Block int64 `json:"block"`
	// Chunk is the token range the block holds.
	Chunk string `json:"chunk"`
	// Connector is the connector that loaded it.
	Connector string `json:"connector"`
	// Rank is the worker rank whose copy of the block was wrong.
	Rank string `json:"rank,omitempty"`
}

func newStats() *stats {
	return &stats{loadedTokens: map[string]int{}, engines: map[string]*EngineCounts{}, deadTurns: map[string]int{}}
}

func (s *stats) update(f func(s *stats)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

// engine updates the counts of engine id.
func (s *stats) engine(id string, f func(c *EngineCounts)) {
	s.update(func(s *stats) { f(s.engineLocked(id)) })
}

// engineLocked returns the counts of engine id, created when missing; s.mu
// must be held.
func (s *stats) engineLocked(id string) *EngineCounts {
	c := s.engines[id]
	if c == nil {
		c = &EngineCounts{}
		s.engines[id] = c
	}
	return c
}

// failure lists why an engine request failed (the turn is counted failed
// when it is finalized).
func (s *stats) failure(f RequestFailure) {
	s.update(func(s *stats) {
		if len(s.failures) < maxListed {
			s.failures = append(s.failures, f)
		}
	})
}

func (s *stats) mismatch(m Mismatch) {
	s.update(func(s *stats) {
		s.mismatchedBlocks++
		if len(s.mismatches) < maxListed {
			s.mismatches = append(s.mismatches, m)
		}
	})
}

// Progress is a snapshot of a running simulation.
type Progress struct {
	// Requests is the total the workload holds.
	Requests int
	// Done and Failed count finished requests.
	Done, Failed int
	// HitRate is the share of prompt tokens not computed so far.
	HitRate float64
	// Mismatches counts byte mismatches so far.
	Mismatches int
	// Preemptions counts preemptions so far.
	Preemptions int
	// DeadRanks counts the ranks found dead so far.
	DeadRanks int
}

func (s *stats) progress() Progress {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Progress{
		Requests: s.requests, Done: s.done, Failed: s.failed,
		HitRate: s.hitRateLocked(), Mismatches: s.mismatchedBlocks, Preemptions: s.preemptions, DeadRanks: s.deadRanks,
	}
}

func (s *stats) hitRateLocked() float64 {
	if s.promptTokens == 0 {
		return 0
	}
	hit := s.localHitTokens
	for _, n := range s.loadedTokens {
		hit += n
	}
	return float64(hit) / float64(s.promptTokens)
}

// Percentiles are latency percentiles in milliseconds.
type Percentiles struct {
	// Count is the number of samples.
	Count int `json:"count"`
	// P50, P90 and P99 are the percentiles, Max the largest sample.
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

func percentiles(d []time.Duration) Percentiles {
	if len(d) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	at := func(q float64) float64 {
		i := int(q*float64(len(s))+0.5) - 1
		i = max(0, min(i, len(s)-1))
		return float64(s[i].Microseconds()) / 1000
	}
	return Percentiles{Count: len(s), P50: at(0.50), P90: at(0.90), P99: at(0.99), Max: float64(s[len(s)-1].Microseconds()) / 1000}
}

// String writes the percentiles for the report's table.
func (p Percentiles) String() string {
	if p.Count == 0 {
		return "-"
	}
	return fmt.Sprintf("p50 %.1f  p90 %.1f  p99 %.1f  max %.1f ms (n=%d)", p.P50, p.P90, p.P99, p.Max, p.Count)
}
