package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

// gpuFamilyPrefix starts the per-GPU families: served only where NVML sees
// GPUs, which kvmesh_gpu_devices (always served by a gpuworker) says.
const gpuFamilyPrefix = "kvmesh_gpu_"

// checkDashboardMetrics scrapes every service of the stack and checks that
// every metric family a Grafana dashboard under deploy/ queries is served
// by at least one of them. Per-GPU families may only be missing when every
// gpuworker reports kvmesh_gpu_devices 0 (no NVML here); they are covered
// with go-nvml's mock in the gpuworker's own tests.
func checkDashboardMetrics(t *testing.T, s *stack) {
	want, err := deploy.DashboardMetrics(testenv.ModuleRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(want) == 0 {
		t.Fatal("the dashboards query no metric")
	}
	served := map[string][]string{} // family → services serving it
	help := map[string]string{}     // family → "# HELP" and "# TYPE" lines
	gpus := 0.0
	for _, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"} {
		families, devices := scrape(t, s.url(name)+"/metrics", help)
		for _, f := range families {
			served[f] = append(served[f], name)
		}
		gpus += devices
	}
	writeCatalogue(t, served, help)
	if _, ok := served["kvmesh_gpu_devices"]; !ok {
		t.Error("no gpuworker serves kvmesh_gpu_devices")
	}
	for _, f := range want {
		if _, ok := served[f]; ok {
			continue
		}
		if strings.HasPrefix(f, gpuFamilyPrefix) && gpus == 0 {
			t.Logf("%s: not served (no GPU visible to NVML on this host)", f)
			continue
		}
		t.Errorf("dashboards query %s, which no service serves", f)
	}
	t.Logf("%d dashboard families checked against %d served families", len(want), len(served))
}

// scrape returns the metric families a /metrics page declares (its
// "# TYPE" lines; a family without series declares none) and the value of
// kvmesh_gpu_devices when present. It adds each family's HELP and TYPE
// lines to help.
func scrape(t *testing.T, url string, help map[string]string) (families []string, gpuDevices float64) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if f, ok := strings.CutPrefix(line, "# TYPE "); ok {
			families = append(families, strings.Fields(f)[0])
		}
		if f, ok := strings.CutPrefix(line, "# "); ok && len(strings.Fields(f)) > 2 {
			name := strings.Fields(f)[1]
			if !strings.Contains(help[name], line) {
				help[name] += line + "\n"
			}
		}
		if v, ok := strings.CutPrefix(line, "kvmesh_gpu_devices "); ok {
			n, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("scrape %s: %q: %v", url, line, err)
			}
			gpuDevices = n
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	return slices.Compact(slices.Sorted(slices.Values(families))), gpuDevices
}

// writeCatalogue writes, with KVMESH_METRICS_OUT set, every kvmesh_ family
// served, with the services serving it and its HELP and TYPE lines (the
// metrics catalogue of docs/observability.md is made from it).
func writeCatalogue(t *testing.T, served map[string][]string, help map[string]string) {
	t.Helper()
	out := os.Getenv("KVMESH_METRICS_OUT")
	if out == "" {
		return
	}
	var b strings.Builder
	for _, f := range slices.Sorted(maps.Keys(served)) {
		if strings.HasPrefix(f, "kvmesh_") {
			fmt.Fprintf(&b, "%s [%s]\n%s", f, strings.Join(slices.Compact(served[f]), ","), help[f])
		}
	}
	if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
		t.Errorf("write %s: %v", out, err)
	}
}

// dashboardQuotaPrefix names the three tenants of playTenantQuotas' run.
const dashboardQuotaPrefix = "dash-quota-"

// dashboardQuotaKeys is the key quota of the two quota tenants of
// playTenantQuotas: fewer keys than one first turn of tenantWorkload saves
// (its 160-token system prompt alone is ten 16-token blocks), so each goes
// over it with its first save.
const dashboardQuotaKeys = 8

// playTenantQuotas makes the stack serve what the store dashboard's
// Tenants row plots, by using quotas as an operator does, and checks what
// a quota promises through the whole mesh. It sets a quota on two of
// three tenants through the sender's PUT /v1/quotas/{tenant} —
// dashboardQuotaKeys keys and 1 GiB, evicting for tenant {prefix}0,
// skipping for tenant {prefix}1; {prefix}2 has none — and plays a run of
// the three, which goes over both quotas. The run is clean (every loaded
// byte right, the ledger balanced, every value still stored right: a
// quota's removals are misses, never wrong loads), and the sender's view
// of each tenant in the report says: {prefix}0 evicted its own blocks,
// within its quota, removals of cause quota; {prefix}1 skipped, evicted
// nothing; {prefix}2 has no quota and lost nothing. The sender serves a
// tenant's usage and quota series only for a tenant with a quota or a
// recent save, and its evicted and skipped counters only once a quota did
// that, so it returns only when the sender's /metrics has all of them.
func playTenantQuotas(t *testing.T, s *stack) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	evict, skip := sim.TenantName(dashboardQuotaPrefix, 0), sim.TenantName(dashboardQuotaPrefix, 1)
	for _, q := range []adminapi.TenantQuota{
		{Tenant: evict, MaxBytes: 1 << 30, MaxKeys: dashboardQuotaKeys, OnFull: adminapi.QuotaEvict},
		{Tenant: skip, MaxBytes: 1 << 30, MaxKeys: dashboardQuotaKeys, OnFull: adminapi.QuotaSkip},
	} {
		body := fmt.Sprintf(`{"max_bytes": %d, "max_keys": %d, "on_full": %q}`, q.MaxBytes, q.MaxKeys, q.OnFull)
		var got adminapi.TenantQuota
		if code := testenv.CallJSONBody(t, http.MethodPut, s.url("sender")+"/v1/quotas/"+q.Tenant, adminToken, body, &got); code != http.StatusOK ||
			got.Tenant != q.Tenant || got.MaxKeys != q.MaxKeys || got.OnFull != q.OnFull {
			t.Fatalf("PUT /v1/quotas/%s %s: %d %+v", q.Tenant, body, code, got)
		}
	}
	w := tenantWorkload(dashboardQuotaPrefix)
	w.Requests, w.Tenants = 12, 3 // two conversations a tenant: several saves of each go over its quota
	rep, err := sim.Run(ctx, simConfig(t, s, false, w))
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	checkTenantStores(t, rep, evict, skip, sim.TenantName(dashboardQuotaPrefix, 2))
	want := []string{
		fmt.Sprintf("kvmesh_sender_tenant_usage_bytes{tenant=%q}", evict),
		fmt.Sprintf("kvmesh_sender_tenant_usage_keys{tenant=%q}", skip),
		fmt.Sprintf("kvmesh_sender_tenant_quota_bytes{tenant=%q}", evict),
		fmt.Sprintf("kvmesh_sender_tenant_quota_keys{tenant=%q}", skip),
		fmt.Sprintf("kvmesh_sender_quota_evicted_blocks_total{tenant=%q}", evict),
		fmt.Sprintf("kvmesh_sender_quota_skipped_blocks_total{tenant=%q}", skip),
	}
	var missing []string
	ok := poll(ctx, 15*time.Second, func() bool { // usage is refreshed every 5 s
		page := metricsPage(t, s.url("sender")+"/metrics")
		missing = slices.DeleteFunc(slices.Clone(want), func(series string) bool { return strings.Contains(page, "\n"+series+" ") })
		return len(missing) == 0
	})
	if !ok {
		t.Fatalf("after a run over both tenants' quotas the sender serves no %v", missing)
	}
}

// checkTenantStores checks the sender's view of playTenantQuotas' three
// tenants in the run's report.
func checkTenantStores(t *testing.T, rep *sim.Report, evict, skip, free string) {
	t.Helper()
	byName := map[string]*sim.TenantStore{}
	for _, tc := range rep.Tenants {
		if tc.Store == nil || tc.Store.Error != "" {
			t.Fatalf("tenant %s: no view from the sender: %+v", tc.Tenant, tc.Store)
		}
		byName[tc.Tenant] = tc.Store
	}
	e, k, f := byName[evict], byName[skip], byName[free]
	switch {
	case e == nil || k == nil || f == nil:
		t.Fatalf("tenants %v; want %s, %s and %s", rep.Tenants, evict, skip, free)
	case e.Quota == nil || e.Quota.EvictedBlocks == 0 || e.Quota.UsageKeys > dashboardQuotaKeys || e.Removed["quota"] == 0:
		t.Fatalf("tenant %s: %+v %+v; want its own blocks evicted, within %d keys, removals of cause quota", evict, e.Quota, e.Removed, dashboardQuotaKeys)
	case k.Quota == nil || k.Quota.SkippedBlocks == 0 || k.Quota.EvictedBlocks != 0 || k.Removed["quota"] != 0:
		t.Fatalf("tenant %s: %+v %+v; want saves skipped, nothing evicted", skip, k.Quota, k.Removed)
	case f.Quota != nil || len(f.Removed) != 0:
		t.Fatalf("tenant %s: %+v %+v; want no quota and nothing removed", free, f.Quota, f.Removed)
	}
}

// metricsPage returns a /metrics page, a newline before its first line.
func metricsPage(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s %v", url, resp.Status, err)
	}
	return "\n" + string(b)
}
