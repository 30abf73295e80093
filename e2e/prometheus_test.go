package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
)

// promScrapeInterval is how often the test's Prometheus scrapes the stack.
const promScrapeInterval = "1s"

// grafanaVariables are the values Grafana's built-in variables take in the
// test: a dashboard's default 5m time range, and the 1m that Grafana makes
// of $__rate_interval (four times its default 15 s scrape interval) — at the
// test's 1 s interval a window of many samples.
var grafanaVariables = map[string]string{
	"__rate_interval": "1m",
	"__interval":      "15s",
	"__range":         "5m",
	"__range_s":       "300",
	"__range_ms":      "300000",
}

// gpuPanels are the dashboard panels (dashboard title, panel title) whose
// queries need a GPU that NVML sees: the gpuworkers serve the per-GPU
// families (kvmesh_gpu_*) only then, so without one these queries return no
// series. They are excused only while every gpuworker reports
// kvmesh_gpu_devices 0.
var gpuPanels = [][2]string{
	{"kvmesh / GPU workers", "GPU memory used and total"},
	{"kvmesh / GPU workers", "GPU utilisation"},
}

// errorPanels are the dashboard panels (dashboard title, panel title) that
// plot failures only, selecting series by an error label value (code 5xx)
// that exist once a failure happened: a clean run may leave them without
// series. When one is empty, every metric it selects must still have
// series, so that it is empty only because nothing failed.
var errorPanels = [][2]string{
	{"kvmesh / Mesh overview", "HTTP 5xx/s by service"},
}

// stackProcesses are the process names of a stack, which are also the
// compose service names that deploy/prometheus.yml scrapes.
var stackProcesses = []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"}

// TestPrometheusDashboards scrapes a running stack with a real Prometheus
// (deploy/prometheus.yml, its targets pointed at the stack, every second),
// plays a short 1P1D run and a run of two tenants over their quotas
// (playTenantQuotas), and evaluates every query of every provisioned
// Grafana dashboard through Prometheus' HTTP API: each must parse and
// evaluate, and each must return at least one series, except those of the
// panels in gpuPanels on a host without GPUs. The dashboards' query
// variables (label_values) must list values too.
func TestPrometheusDashboards(t *testing.T) {
	root := testenv.ModuleRoot(t)
	dashboards, err := deploy.LoadDashboards(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(dashboards) == 0 {
		t.Fatal("no dashboards under " + deploy.DashboardsDir)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 48})
	cfg, targets := prometheusConfig(t, root, s)
	prom := testenv.StartPrometheus(t, cfg)
	waitTargetsUp(ctx, t, prom, targets)

	rep, err := sim.Run(ctx, simConfig(t, s, true, smallWorkload(24, 8)))
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	playTenantQuotas(t, s) // the Tenants row's series: tenants with quotas that evict and skip
	waitScrapesAfter(ctx, t, prom, time.Now(), 2)

	gpus := promScalar(ctx, t, prom, "sum(kvmesh_gpu_devices)")
	excused := map[[2]string]bool{}
	if gpus == 0 {
		for _, p := range gpuPanels {
			excused[p] = true
		}
	}
	errorOnly := map[[2]string]bool{}
	for _, p := range errorPanels {
		errorOnly[p] = true
	}
	seen := map[[2]string]bool{}
	total, withSeries, gpuOnly, noFailures := 0, 0, 0, 0
	for _, d := range dashboards {
		vars := dashboardVariables(t, root, d)
		for _, p := range d.AllPanels() {
			key := [2]string{d.Title, p.Title}
			seen[key] = true
			for _, tg := range p.Targets {
				if tg.Expr == "" {
					continue
				}
				total++
				where := fmt.Sprintf("%s / panel %q / %s", d.File, p.Title, tg.RefID)
				expr, err := substitute(tg.Expr, vars)
				if err != nil {
					t.Errorf("%s: %v", where, err)
					continue
				}
				res, err := prom.Query(ctx, expr)
				switch {
				case err != nil:
					t.Errorf("%s: %v", where, err)
				case len(res.Series) > 0:
					withSeries++
				case excused[key]:
					gpuOnly++
					t.Logf("%s: no series (needs a GPU, none visible to NVML): %s", where, expr)
				case errorOnly[key]:
					noFailures++
					requireMetricsPresent(ctx, t, prom, where, expr)
					t.Logf("%s: no series (plots failures; none happened): %s", where, expr)
				default:
					t.Errorf("%s: %s returned no series (result type %s, warnings %v)", where, expr, res.ResultType, res.Warnings)
				}
			}
		}
		checkVariableQueries(ctx, t, prom, d)
	}
	for _, p := range append(slices.Clone(gpuPanels), errorPanels...) {
		if !seen[p] {
			t.Errorf("the test excuses panel %q / %q, which no dashboard has", p[0], p[1])
		}
	}
	if total == 0 {
		t.Fatal("the dashboards hold no Prometheus expression")
	}
	t.Logf("%d dashboard expressions evaluated: %d returned series, %d empty GPU-only (gpus %g), %d empty failure-only",
		total, withSeries, gpuOnly, gpus, noFailures)
	if t.Failed() {
		t.Logf("prometheus log:\n%s", tail(prom.Output(), 40))
	}
}

// prometheusConfig returns deploy/prometheus.yml with its targets (compose
// service names) replaced by the stack's addresses and every interval set
// to promScrapeInterval, and the number of targets it scrapes.
func prometheusConfig(t *testing.T, root string, s *stack) (string, int) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, deploy.PrometheusFile))
	if err != nil {
		t.Fatal(err)
	}
	out, n, err := deploy.RetargetPrometheus(data, promScrapeInterval, func(host string) (string, bool) {
		if !slices.Contains(stackProcesses, host) {
			return "", false
		}
		return s.mesh.Procs.Process(host).Addr(), true
	})
	if err != nil {
		t.Fatalf("%v (the stack runs %v)", err, stackProcesses)
	}
	if n != len(stackProcesses) {
		t.Fatalf("%s scrapes %d targets, want one per process of the stack %v", deploy.PrometheusFile, n, stackProcesses)
	}
	return string(out), n
}

// waitTargetsUp polls /api/v1/targets until want targets are active and
// every one is up.
func waitTargetsUp(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, want int) {
	t.Helper()
	var last string
	ok := poll(ctx, 30*time.Second, func() bool {
		ts, err := prom.Targets(ctx)
		if err != nil {
			last = err.Error()
			return false
		}
		up := 0
		var b strings.Builder
		for _, tg := range ts {
			fmt.Fprintf(&b, "%s %s %s %q; ", tg.ScrapePool, tg.ScrapeURL, tg.Health, tg.LastError)
			if tg.Health == "up" {
				up++
			}
		}
		last = b.String()
		return len(ts) == want && up == want
	})
	if !ok {
		t.Fatalf("prometheus targets not all up (want %d): %s\n%s", want, last, tail(prom.Output(), 40))
	}
}

// waitScrapesAfter polls /api/v1/targets until every target has completed
// at least n scrapes that started after since (Prometheus reports a scrape
// once its samples are stored), the last of them successful.
func waitScrapesAfter(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, since time.Time, n int) {
	t.Helper()
	seen := map[string]map[time.Time]bool{} // scrape URL → scrape start times after since
	var last string
	ok := poll(ctx, 30*time.Second, func() bool {
		ts, err := prom.Targets(ctx)
		if err != nil {
			last = err.Error()
			return false
		}
		done := len(ts) > 0
		var b strings.Builder
		for _, tg := range ts {
			if tg.LastScrape.After(since) {
				if seen[tg.ScrapeURL] == nil {
					seen[tg.ScrapeURL] = map[time.Time]bool{}
				}
				seen[tg.ScrapeURL][tg.LastScrape] = true
			}
			fmt.Fprintf(&b, "%s: %d scrapes, %s %q; ", tg.ScrapeURL, len(seen[tg.ScrapeURL]), tg.Health, tg.LastError)
			done = done && len(seen[tg.ScrapeURL]) >= n && tg.Health == "up"
		}
		last = b.String()
		return done
	})
	if !ok {
		t.Fatalf("no %d scrapes of every target after the run: %s", n, last)
	}
}

// poll calls cond every 100 ms until it returns true (poll returns true),
// or within passes or ctx ends (false).
func poll(ctx context.Context, within time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if cond() {
			return true
		}
		select {
		case <-ctx.Done():
			return cond()
		case <-tick.C:
		}
	}
}

// promScalar evaluates expr, which must return one series, and returns its
// value; no series is 0.
func promScalar(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, expr string) float64 {
	t.Helper()
	res, err := prom.Query(ctx, expr)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Series) == 0 {
		return 0
	}
	if len(res.Series) != 1 || len(res.Series[0].Value) != 2 {
		t.Fatalf("%s: want one sample, got %+v", expr, res.Series)
	}
	v, err := strconv.ParseFloat(fmt.Sprint(res.Series[0].Value[1]), 64)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	return v
}

// requireMetricsPresent fails the test unless every metric that expr
// selects has at least one series in Prometheus.
func requireMetricsPresent(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, where, expr string) {
	t.Helper()
	names := deploy.MetricNames(expr)
	if len(names) == 0 {
		t.Errorf("%s: %s selects no metric", where, expr)
	}
	for _, name := range names {
		res, err := prom.Query(ctx, fmt.Sprintf("count({__name__=%q})", name))
		switch {
		case err != nil:
			t.Errorf("%s: %v", where, err)
		case len(res.Series) == 0:
			t.Errorf("%s: %s returned no series, and %s has none either", where, expr, name)
		}
	}
}

// labelValuesRe matches Grafana's label_values(query, label).
var labelValuesRe = regexp.MustCompile(`^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)

// checkVariableQueries evaluates a dashboard's label_values(query, label)
// variables: the query must return series that carry the label, so that
// the variable offers values.
func checkVariableQueries(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, d deploy.Dashboard) {
	t.Helper()
	for _, v := range d.Templating.List {
		q := strings.TrimSpace(v.QueryText())
		if v.Type != "query" || q == "" || (v.Datasource != nil && v.Datasource.Type != "prometheus") {
			continue
		}
		m := labelValuesRe.FindStringSubmatch(q)
		if m == nil {
			t.Errorf("%s: variable %s: query %q is not label_values(query, label)", d.File, v.Name, q)
			continue
		}
		res, err := prom.Query(ctx, fmt.Sprintf("count by (%s) (%s)", m[2], m[1]))
		if err != nil {
			t.Errorf("%s: variable %s: %v", d.File, v.Name, err)
			continue
		}
		var values []string
		for _, s := range res.Series {
			if s.Metric[m[2]] != "" {
				values = append(values, s.Metric[m[2]])
			}
		}
		if len(values) == 0 {
			t.Errorf("%s: variable %s: %s offers no value", d.File, v.Name, q)
			continue
		}
		t.Logf("%s: variable %s offers %v", d.File, v.Name, values)
	}
}

// dashboardVariable is the part of a dashboard variable that its value
// when "All" is selected needs (deploy.Variable leaves it out).
type dashboardVariable struct {
	Name       string `json:"name"`
	IncludeAll bool   `json:"includeAll"`
	AllValue   string `json:"allValue"`
}

// dashboardVariables returns Grafana's built-in variables and d's template
// variables, each with its "All" value (allValue, or .* when unset): the
// dashboards' defaults select All.
func dashboardVariables(t *testing.T, root string, d deploy.Dashboard) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, d.File))
	if err != nil {
		t.Fatal(err)
	}
	var model struct {
		Templating struct {
			List []dashboardVariable `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &model); err != nil {
		t.Fatalf("%s: %v", d.File, err)
	}
	vars := map[string]string{}
	for k, v := range grafanaVariables {
		vars[k] = v
	}
	for _, v := range model.Templating.List {
		switch {
		case v.IncludeAll && v.AllValue != "":
			vars[v.Name] = v.AllValue
		case v.IncludeAll:
			vars[v.Name] = ".*"
		}
	}
	return vars
}

// variableRe matches a Grafana variable: $name, ${name} or ${name:format}.
var variableRe = regexp.MustCompile(`\$(?:\{([a-zA-Z_][a-zA-Z0-9_]*)(?::[a-z]+)?\}|([a-zA-Z_][a-zA-Z0-9_]*))`)

// substitute replaces the Grafana variables of expr with their values in
// vars; a variable without one is an error.
func substitute(expr string, vars map[string]string) (string, error) {
	var missing []string
	out := variableRe.ReplaceAllStringFunc(expr, func(m string) string {
		sub := variableRe.FindStringSubmatch(m)
		name := sub[1] + sub[2]
		v, ok := vars[name]
		if !ok {
			missing = append(missing, name)
			return m
		}
		return v
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("%s: no value for Grafana variable(s) %v", expr, missing)
	}
	return out, nil
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
