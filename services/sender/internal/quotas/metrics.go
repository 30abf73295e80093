package quotas

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// Metrics are the quotas' series on /metrics.
type Metrics struct {
	usageBytes, usageKeys *prometheus.GaugeVec
	quotaBytes, quotaKeys *prometheus.GaugeVec
	evicted, skipped      *prometheus.CounterVec
}

// NewMetrics registers the quotas' series on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, []string{"tenant"})
	}
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"tenant"})
	}
	m := &Metrics{
		usageBytes: gauge("kvmesh_sender_tenant_usage_bytes", "Bytes of values a tenant holds in the store (its namespaces' store-time indexes times their value size), for every tenant with a quota or a save in the last hour."),
		usageKeys:  gauge("kvmesh_sender_tenant_usage_keys", "Keys a tenant holds in the store (its namespaces' store-time indexes), for every tenant with a quota or a save in the last hour."),
		quotaBytes: gauge("kvmesh_sender_tenant_quota_bytes", "A tenant's byte quota (0: unlimited), for every tenant with a quota."),
		quotaKeys:  gauge("kvmesh_sender_tenant_quota_keys", "A tenant's key quota (0: unlimited), for every tenant with a quota."),
		evicted:    counter("kvmesh_sender_quota_evicted_blocks_total", "A tenant's blocks this sender removed from the store to keep the tenant within its quota (BlockRemoved with cause quota)."),
		skipped:    counter("kvmesh_sender_quota_skipped_blocks_total", "Blocks of a tenant's saves skipped because they did not fit its quota (save outcome skipped, reason quota)."),
	}
	if err := telemetry.RegisterAll(reg, m.usageBytes, m.usageKeys, m.quotaBytes, m.quotaKeys, m.evicted, m.skipped); err != nil {
		return nil, fmt.Errorf("quota metrics: %w", err)
	}
	return m, nil
}

// show sets tenant's usage, and its quota when it has one.
func (m *Metrics) show(tenant string, u sendpolicy.Usage, q Quota) {
	m.usageBytes.WithLabelValues(tenant).Set(float64(u.Bytes))
	m.usageKeys.WithLabelValues(tenant).Set(float64(u.Keys))
	if q.Tenant == "" {
		m.dropQuota(tenant)
		return
	}
	m.showQuota(q)
}

// showQuota sets q's series.
func (m *Metrics) showQuota(q Quota) {
	m.quotaBytes.WithLabelValues(q.Tenant).Set(float64(q.MaxBytes))
	m.quotaKeys.WithLabelValues(q.Tenant).Set(float64(q.MaxKeys))
}

// dropQuota removes tenant's quota series.
func (m *Metrics) dropQuota(tenant string) {
	m.quotaBytes.DeleteLabelValues(tenant)
	m.quotaKeys.DeleteLabelValues(tenant)
}

// drop removes tenant's usage and quota series.
func (m *Metrics) drop(tenant string) {
	for _, g := range []*prometheus.GaugeVec{m.usageBytes, m.usageKeys, m.quotaBytes, m.quotaKeys} {
		g.DeleteLabelValues(tenant)
	}
}
