package sim

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// The gpuworker metrics the per-rank report reads (deltas over the run).
const (
	// metricStoreBytes is kvmesh_store_bytes_total; its op="save_put"
	// series counts the value bytes the worker's puts stored.
	metricStoreBytes = "kvmesh_store_bytes_total"
	// metricLoadBytes counts the block bytes loads wrote into the pool.
	metricLoadBytes = "kvmesh_gpuworker_load_bytes_total"
	// metricLoadSeconds is the load duration histogram; its _sum is the
	// worker's load time. Workers without it have no load-time column.
	metricLoadSeconds = "kvmesh_gpuworker_load_duration_seconds"
)

// scrapeTimeout bounds one scrape of a gpuworker's /metrics.
const scrapeTimeout = 5 * time.Second

// workerMetrics are the counters of one gpuworker's /metrics the report
// uses.
type workerMetrics struct {
	savePutBytes   float64
	loadBytes      float64
	loadSeconds    float64
	hasLoadSeconds bool
}

// scrapeWorker reads the gpuworker's /metrics at base.
func scrapeWorker(ctx context.Context, hc *http.Client, base string) (workerMetrics, error) {
	ctx, cancel := context.WithTimeout(ctx, scrapeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return workerMetrics{}, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return workerMetrics{}, fmt.Errorf("GET %s/metrics: %w", base, err)
	}
	defer drainClose(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return workerMetrics{}, fmt.Errorf("GET %s/metrics: %d: %w", base, resp.StatusCode, ErrHTTP)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return workerMetrics{}, fmt.Errorf("GET %s/metrics: %w", base, err)
	}
	return parseWorkerMetrics(body)
}

// parseWorkerMetrics picks the report's counters out of a Prometheus text
// exposition.
func parseWorkerMetrics(body []byte) (workerMetrics, error) {
	fams, err := telemetry.ParseExposition(body)
	if err != nil {
		return workerMetrics{}, err
	}
	var w workerMetrics
	if v := telemetry.SumSeries(fams[metricStoreBytes], "op", "save_put"); v != nil {
		w.savePutBytes = *v
	}
	if v := telemetry.SumSeries(fams[metricLoadBytes], "", ""); v != nil {
		w.loadBytes = *v
	}
	if f := fams[metricLoadSeconds]; f != nil {
		w.hasLoadSeconds = true
		for _, m := range f.GetMetric() {
			w.loadSeconds += m.GetHistogram().GetSampleSum()
		}
	}
	return w, nil
}

// scrapeRanks scrapes every live rank's /metrics, into before at the
// start of the run, else into after. A failed scrape is kept as the rank's
// metricsErr: the rank then has no metric figures.
func (r *run) scrapeRanks(ctx context.Context, before bool) {
	var g errgroup.Group
	g.SetLimit(2 * rankParallelism)
	for _, e := range r.engines {
		for _, rw := range e.ranks {
			if rw.dead != nil || rw.metricsErr != nil {
				continue
			}
			g.Go(func() error {
				m, err := scrapeWorker(ctx, r.cfg.HTTPClient, rw.url)
				switch {
				case err != nil:
					rw.metricsErr = err
				case before:
					rw.before = m
				default:
					rw.after = m
				}
				return nil
			})
		}
	}
	_ = g.Wait() // the scrapes report through metricsErr
}
