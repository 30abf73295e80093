// Package metrics holds the gpuworker's Prometheus metrics: pool occupancy,
// GPU memory and utilisation (read at scrape time), store operations and
// loads.
package metrics

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// Store operation labels.
const (
	// OpLoadGet is a load's batched Get.
	OpLoadGet = "load_get"
	// OpSavePut is a data-plane put's batched Put.
	OpSavePut = "save_put"
)

// Refusal labels of kvmesh_gpuworker_not_held_total: the read that found a
// block not holding the asked hash.
const (
	// OpPut is a data-plane put (a save) reading a pool block.
	OpPut = "put"
	// OpRead is a data-plane read (a pd load or a verification).
	OpRead = "read"
	// OpLoadSource is a pd load's remote read as the receiving worker saw it.
	OpLoadSource = "pd_source"
)

// Metrics are the gpuworker's own metric families. Store latency, keys and
// failed keys come from kvstore.Instrument (kvmesh_store_op_duration_seconds,
// kvmesh_store_keys_total, kvmesh_store_failed_keys_total, and vLLM's
// vllm:mooncake_store_operation_* families under the operations OpSavePut
// and OpLoadGet, labelled with the worker's model and engine); this adds the
// bytes moved and the values a load rejected after the store returned them.
type Metrics struct {
	storeBytes *prometheus.CounterVec
	rejected   *prometheus.CounterVec
	loads      *prometheus.CounterVec
	loadErrors prometheus.Counter
	loadBytes  prometheus.Counter
	loadTime   *prometheus.HistogramVec
	notHeld    *prometheus.CounterVec
	// unindexed counts stored keys whose store time was not recorded.
	unindexed prometheus.Counter
}

// New registers the metrics on reg, with collectors that read the pool and
// the GPU inventory at scrape time.
func New(reg prometheus.Registerer, stats func() []pool.GroupStats, gpus *devices.Source) (*Metrics, error) {
	m := &Metrics{
		storeBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_store_bytes_total", Help: "Value bytes moved to or from the store, by operation.",
		}, []string{"op"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_rejected_values_total",
			Help: "Stored values a load refused to write into the pool, by reason (fingerprint, checksum, malformed, size).",
		}, []string{"reason"}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_loads_total", Help: "Load tasks handled, by outcome (ok, load_errors, unplanned, ignored, dead_lettered, stale: older than KVMESH_LOAD_MAX_AGE, refused with every block a load error).",
		}, []string{"outcome"}),
		loadErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_load_error_blocks_total", Help: "Blocks reported as load errors.",
		}),
		loadBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_load_bytes_total", Help: "Block bytes written into the pool by loads.",
		}),
		loadTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvmesh_gpuworker_load_duration_seconds",
			Help:    "Time this worker took to load its share of one load task, by connector (store, pd): the slowest rank of an engine sets when finished_recving can follow.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"connector"}),
		notHeld: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_not_held_total",
			Help: "Block reads refused because the block does not hold the asked hash (never written since start, evicted, rewritten or torn), by operation (put, read, pd_source).",
		}, []string{"op"}),
		unindexed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_store_times_unrecorded_total",
			Help: "Keys this worker stored whose store time it could not record (the index write failed): their removals will not say the block's age.",
		}),
	}
	if err := telemetry.RegisterAll(reg, m.storeBytes, m.rejected, m.loads, m.loadErrors, m.loadBytes, m.loadTime, m.notHeld, m.unindexed,
		&poolCollector{stats: stats}, &gpuCollector{src: gpus}); err != nil {
		return nil, fmt.Errorf("gpuworker metrics: %w", err)
	}
	// Every series dashboards key on exists from the start, at 0.
	for _, reason := range rejectReasons {
		m.rejected.WithLabelValues(reason)
	}
	for _, op := range []string{OpSavePut, OpLoadGet} {
		m.storeBytes.WithLabelValues(op)
	}
	for _, outcome := range loadOutcomes {
		m.loads.WithLabelValues(outcome)
	}
	for _, op := range []string{OpPut, OpRead, OpLoadSource} {
		m.notHeld.WithLabelValues(op)
	}
	for _, c := range []string{"store", "pd"} {
		m.loadTime.WithLabelValues(c)
	}
	return m, nil
}

// loadOutcomes are the outcome label values of kvmesh_gpuworker_loads_total
// (the load package's Outcome constants).
var loadOutcomes = []string{"ok", "load_errors", "unplanned", "ignored", "dead_lettered", "stale"}

// rejectReasons are the values of RejectReason.
var rejectReasons = []string{"fingerprint", "checksum", "malformed", "size", "other"}

// StoreBytes counts value bytes moved by one store operation.
func (m *Metrics) StoreBytes(op string, n int64) {
	m.storeBytes.WithLabelValues(op).Add(float64(n))
}

// NotHeld counts one block read refused because the block does not hold
// the asked hash.
func (m *Metrics) NotHeld(op string) {
	m.notHeld.WithLabelValues(op).Inc()
}

// StoreTimesUnrecorded counts n stored keys whose store time was not
// recorded.
func (m *Metrics) StoreTimesUnrecorded(n int) {
	m.unindexed.Add(float64(n))
}

// Rejected counts a stored value a load refused, by the reason in err.
func (m *Metrics) Rejected(err error) {
	m.rejected.WithLabelValues(RejectReason(err)).Inc()
}

// Load counts one handled load task by outcome, with its error blocks and
// the bytes written.
func (m *Metrics) Load(outcome string, errorBlocks int, bytes int64) {
	m.loads.WithLabelValues(outcome).Inc()
	m.loadErrors.Add(float64(errorBlocks))
	m.loadBytes.Add(float64(bytes))
}

// LoadTime observes how long one load task took this worker, by connector.
func (m *Metrics) LoadTime(connector string, took time.Duration) {
	m.loadTime.WithLabelValues(connector).Observe(took.Seconds())
}

// RejectReason is the reason label of a refused value.
func RejectReason(err error) string {
	switch {
	case errors.Is(err, dataplane.ErrFingerprint):
		return "fingerprint"
	case errors.Is(err, dataplane.ErrChecksum):
		return "checksum"
	case errors.Is(err, dataplane.ErrFrame):
		return "malformed"
	case errors.Is(err, pool.ErrSize):
		return "size"
	}
	return "other"
}

// poolCollector reports kvmesh_gpuworker_pool_blocks{group,state}.
type poolCollector struct {
	stats func() []pool.GroupStats
}

var poolBlocksDesc = prometheus.NewDesc("kvmesh_gpuworker_pool_blocks",
	"Pool blocks per KV group, by state (in_use: holding an identity, written and not evicted, reset or torn since; free).",
	[]string{"group", "state"}, nil)

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- poolBlocksDesc }

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for _, g := range c.stats() {
		group := strconv.Itoa(g.Group)
		ch <- prometheus.MustNewConstMetric(poolBlocksDesc, prometheus.GaugeValue, float64(g.InUse), group, "in_use")
		ch <- prometheus.MustNewConstMetric(poolBlocksDesc, prometheus.GaugeValue, float64(g.Blocks-g.InUse), group, "free")
	}
}

// gpuCollector reports the GPU inventory at scrape time.
type gpuCollector struct {
	src *devices.Source
}

var (
	gpuDevicesDesc = prometheus.NewDesc("kvmesh_gpu_devices",
		"GPUs NVML reports on this worker's host (0 when NVML is unavailable: the per-GPU families are then absent).", nil, nil)
	gpuMemUsedDesc = prometheus.NewDesc("kvmesh_gpu_memory_used_bytes",
		"GPU memory in use, by GPU UUID.", []string{"gpu"}, nil)
	gpuMemTotalDesc = prometheus.NewDesc("kvmesh_gpu_memory_total_bytes",
		"GPU memory, by GPU UUID.", []string{"gpu"}, nil)
	gpuUtilDesc = prometheus.NewDesc("kvmesh_gpu_utilization_ratio",
		"GPU busy fraction over NVML's last sample period, by GPU UUID.", []string{"gpu"}, nil)
)

func (c *gpuCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- gpuDevicesDesc
	ch <- gpuMemUsedDesc
	ch <- gpuMemTotalDesc
	ch <- gpuUtilDesc
}

func (c *gpuCollector) Collect(ch chan<- prometheus.Metric) {
	inv := c.src.Inventory()
	ch <- prometheus.MustNewConstMetric(gpuDevicesDesc, prometheus.GaugeValue, float64(len(inv.Devices)))
	for _, d := range inv.Devices {
		gpu := d.UUID
		if gpu == "" {
			gpu = strconv.Itoa(d.Index)
		}
		ch <- prometheus.MustNewConstMetric(gpuMemUsedDesc, prometheus.GaugeValue, float64(d.MemoryUsedBytes), gpu)
		ch <- prometheus.MustNewConstMetric(gpuMemTotalDesc, prometheus.GaugeValue, float64(d.MemoryTotalBytes), gpu)
		if d.Utilization != nil {
			ch <- prometheus.MustNewConstMetric(gpuUtilDesc, prometheus.GaugeValue, *d.Utilization, gpu)
		}
	}
}
