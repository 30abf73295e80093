package sim

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// rankParallelism bounds the gpuworker calls one engine has in flight at
// once: its ranks are written, read and evicted in parallel, at most this
// many at a time.
const rankParallelism = 8

// LayoutText names a model's parallel layout: "TP8", "TP2 PP2", "TP4 DCP2";
// a single-rank model is "TP1".
func LayoutText(m *kvcore.Model) string {
	p := m.Parallel
	parts := []string{fmt.Sprintf("TP%d", max(1, p.TP))}
	for _, d := range []struct {
		name string
		v    int
	}{{"PCP", p.PCP}, {"DCP", p.DCP}, {"PP", p.PP}} {
		if d.v > 1 {
			parts = append(parts, fmt.Sprintf("%s%d", d.name, d.v))
		}
	}
	return strings.Join(parts, " ")
}

// endpoints lists every engine of the fleet: each decode engine, and its
// prefill engine with PD.
func (c *Config) endpoints() []*Endpoint {
	var eps []*Endpoint
	for i := range c.Fleet {
		eps = append(eps, &c.Fleet[i].Decode)
		if c.PD {
			eps = append(eps, &c.Fleet[i].Prefill)
		}
	}
	return eps
}

// checkFleetURLs checks that every engine of the fleet names one gpuworker
// per worker rank of the model.
func (c *Config) checkFleetURLs() error {
	world := c.Model.WorldSize()
	for i, p := range c.Fleet {
		n := len(p.Decode.URLs())
		switch {
		case n == 0:
			return fmt.Errorf("engine %d: the gpuworker URL is required: %w", i, ErrConfig)
		case n != world:
			return fmt.Errorf("engine %d: %d gpuworker URLs for the model's %d worker ranks (%s): give one per rank: %w", i, n, world, LayoutText(c.Model), ErrConfig)
		}
		if !c.PD {
			continue
		}
		switch n := len(p.Prefill.URLs()); {
		case n == 0:
			return fmt.Errorf("engine %d: 1P1D needs the prefill engine's gpuworker URL: %w", i, ErrConfig)
		case n != world:
			return fmt.Errorf("engine %d: %d prefill gpuworker URLs for the model's %d worker ranks (%s): give one per rank: %w", i, n, world, LayoutText(c.Model), ErrConfig)
		}
	}
	return nil
}

// poolInfo is the part of a gpuworker's GET /v1/pool the simulator uses.
type poolInfo struct {
	EngineID    string      `json:"engine_id"`
	Model       string      `json:"model"`
	Fingerprint string      `json:"fingerprint"`
	Rank        kvcore.Rank `json:"rank"`
	Groups      []struct {
		Blocks int `json:"blocks"`
	} `json:"groups"`
}

// blocks is the smallest group pool.
func (p poolInfo) blocks() int {
	n := 0
	for i, g := range p.Groups {
		if i == 0 || g.Blocks < n {
			n = g.Blocks
		}
	}
	return n
}

func workerPool(ctx context.Context, hc *http.Client, base string) (poolInfo, error) {
	var info poolInfo
	if err := getJSON(ctx, hc, base+"/v1/pool", &info); err != nil {
		return info, fmt.Errorf("gpuworker pool: %w", err)
	}
	return info, nil
}

// workers asks every gpuworker of every engine for its pool: it fills in
// engine ids left empty, checks that each serves the simulator's model
// layout as the rank its place in the list says, and caps the engines'
// pools at the workers' smallest group pool.
func (c *Config) workers(ctx context.Context) error {
	eps := c.endpoints()
	infos := make([][]poolInfo, len(eps))
	var g errgroup.Group
	g.SetLimit(2 * rankParallelism)
	for i, ep := range eps {
		urls := ep.URLs()
		infos[i] = make([]poolInfo, len(urls))
		for k, u := range urls {
			g.Go(func() error {
				info, err := workerPool(ctx, c.HTTPClient, u)
				infos[i][k] = info
				return err
			})
		}
	}
	if err := g.Wait(); err != nil {
		return err
	}
	seen := map[string]string{}
	for i, ep := range eps {
		if err := c.checkEngineWorkers(ep, infos[i]); err != nil {
			return err
		}
		if url, dup := seen[ep.EngineID]; dup {
			return fmt.Errorf("gpuworkers %s and %s both hold engine %q; every engine needs gpuworkers of its own: %w", url, ep.URLs()[0], ep.EngineID, ErrConfig)
		}
		seen[ep.EngineID] = ep.URLs()[0]
	}
	if c.Engine.Watermark >= c.Engine.PoolBlocks {
		return fmt.Errorf("watermark %d with a pool of %d blocks: %w", c.Engine.Watermark, c.Engine.PoolBlocks, ErrConfig)
	}
	return nil
}

// checkEngineWorkers checks one engine's workers, rank by rank, and caps
// the pool at theirs.
func (c *Config) checkEngineWorkers(ep *Endpoint, infos []poolInfo) error {
	urls, ranks := ep.URLs(), c.Model.WorkerRanks()
	if ep.EngineID == "" {
		ep.EngineID = infos[0].EngineID
	}
	fp := c.Model.Fingerprint()
	for k, info := range infos {
		u := urls[k]
		switch {
		case info.Model != c.Model.Name || info.Fingerprint != fp:
			return fmt.Errorf("gpuworker %s serves model %s (%s), the simulator %s %s (%s): start the stack with the same model and KVMESH_TP/PCP/DCP/PP: %w",
				u, info.Model, info.Fingerprint, c.Model.Name, LayoutText(c.Model), fp, ErrConfig)
		case info.EngineID != ep.EngineID:
			return fmt.Errorf("gpuworker %s holds engine %q, not %q (every rank of an engine serves the same engine id): %w", u, info.EngineID, ep.EngineID, ErrConfig)
		case info.Rank != ranks[k]:
			return fmt.Errorf("gpuworker %s is rank %s, expected %s of engine %s (%s, %d ranks per engine, listed in worker-rank order): start the stack with the same KVMESH_TP: %w",
				u, info.Rank, ranks[k], ep.EngineID, LayoutText(c.Model), len(ranks), ErrConfig)
		}
		n := info.blocks()
		if n < 1 {
			return fmt.Errorf("gpuworker %s has an empty pool: %w", u, ErrHTTP)
		}
		if c.Engine.PoolBlocks == 0 || c.Engine.PoolBlocks > n {
			c.Engine.PoolBlocks = n
		}
	}
	return nil
}

// rankWorker is one worker rank of an engine: its gpuworker, whether it
// died, and what the engine did with it. Only the engine's goroutine
// changes it (a call on ranks in parallel touches only its own rank), and
// the report reads it once the engines stopped.
type rankWorker struct {
	rank   kvcore.Rank
	index  int // in Model.WorkerRanks
	url    string
	client *dataplane.Client

	// dead is why the rank is dead (its gpuworker stayed unreachable for
	// the rank timeout), nil while it lives; deadAt is when it was found.
	dead   error
	deadAt time.Time

	// mem is the KV memory the engine owns and registered with the rank's
	// gpuworker; nil writes over the data plane (KVMemoryHTTP).
	mem            *rankMemory
	blocksWritten  int   // blocks written into its pool
	bytesWritten   int64 // their bytes
	verified       int   // loaded blocks read back and compared on it
	mismatched     int   // of those, wrong bytes
	lost           int   // loaded blocks it no longer held
	unverified     int   // loaded blocks not verified: the rank was dead
	failedRequests int   // engine requests failed because it was dead
	loadsMissing   int   // loads the scheduler finished without its report
	// before and after are its /metrics at the start and the end of the
	// run; metricsErr says why a scrape failed (no figures then).
	before, after workerMetrics
	metricsErr    error
}

// label names the rank for a report and a failure reason.
func (rw *rankWorker) label() string { return rw.rank.String() }

// deadReason is the failure reason of a request that needed a dead rank.
func (e *engine) deadReason(rw *rankWorker) string {
	return fmt.Sprintf("rank %s of engine %s is dead (gpuworker %s unreachable; see dead_ranks)", rw.label(), e.id, rw.url)
}

// newRankWorkers makes the rank workers of one engine from its URLs, in
// WorkerRanks order.
func newRankWorkers(m *kvcore.Model, urls []string, hc *http.Client) []*rankWorker {
	ranks := m.WorkerRanks()
	out := make([]*rankWorker, len(ranks))
	for k, r := range ranks {
		out[k] = &rankWorker{rank: r, index: k, url: urls[k], client: dataplane.NewClient(urls[k], hc)}
	}
	return out
}

// deadRank is the engine's first dead rank, nil while every rank lives.
func (e *engine) deadRank() *rankWorker {
	for _, rw := range e.ranks {
		if rw.dead != nil {
			return rw
		}
	}
	return nil
}

// onRanks calls f on every live rank, up to rankParallelism at once, each
// call retried for up to the rank timeout. A rank whose call kept failing
// for that long is marked dead; a call refused for good
// (dataplane.ErrRejected, ErrIdentity: a simulator bug) is returned as the
// error, and so is ctx's error once it ended. A SIGKILLed worker refuses
// connections, so it is found dead after the rank timeout; one that hangs,
// once its calls timed out (the HTTP client's timeout) past the rank
// timeout. f must touch only its own rank.
func (e *engine) onRanks(ctx context.Context, what string, f func(ctx context.Context, rw *rankWorker) error) error {
	errs := make([]error, len(e.ranks))
	var wg sync.WaitGroup
	sem := make(chan struct{}, rankParallelism)
	for k, rw := range e.ranks {
		if rw.dead != nil {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[k] = retryFor(ctx, e.rankTimeout, func() error { return f(ctx, rw) })
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return err // the run is over: nothing is dead, nothing was done for sure
	}
	var fatal []error
	for k, err := range errs {
		rw := e.ranks[k]
		switch {
		case err == nil:
		case permanent(err):
			fatal = append(fatal, fmt.Errorf("engine %s rank %s: %s: %w", e.id, rw.label(), what, err))
		default:
			rw.dead, rw.deadAt = fmt.Errorf("%s: %w", what, err), time.Now()
			e.stats.update(func(st *stats) { st.deadRanks++ })
			e.log.Warn("gpuworker rank dead: unreachable for the rank timeout", "engine", e.id, "rank", rw.label(), "url", rw.url, "timeout", e.rankTimeout, "err", err)
		}
	}
	return errors.Join(fatal...)
}
