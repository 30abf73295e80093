package deploy_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// vllmAlertExpr is the alert example of docs/observability.md: the share
// of store operations, per operation, that did not end ok over 5 minutes.
const vllmAlertExpr = `sum by (operation) (rate(vllm:mooncake_store_operation_total{status!="ok"}[5m]))
  / sum by (operation) (rate(vllm:mooncake_store_operation_total[5m])) > 0.05`

// TestVLLMFamiliesScrapedByPrometheus serves the store families of a
// lookup, a sender and two gpuworkers (each wrapper labelled as the
// services label theirs, over a real redis-server), has a real Prometheus
// scrape them with deploy/prometheus.yml's jobs and engine labels, drives
// ok, partial_failure and error operations, and then evaluates every
// dashboard expression that selects a vllm: family and the alert example
// of docs/observability.md: each must evaluate and return series, and the
// sums by operation and status must be the operations driven.
func TestVLLMFamiliesScrapedByPrometheus(t *testing.T) {
	root := testenv.ModuleRoot(t)
	srv := testenv.StartRedis(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	store, err := kvstore.NewRedis(ctx, srv.URL(), kvstore.RedisOptions{MaxValueBytes: 8, MaxRetries: -1, DialAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })

	const model = "hybrid-mla-linear"
	// One registry and /metrics per process of deploy/prometheus.yml.
	addrs := map[string]string{}
	serve := func(name string) *kvstore.Metrics {
		reg := prometheus.NewRegistry()
		m, err := kvstore.NewMetrics(reg)
		if err != nil {
			t.Fatal(err)
		}
		h := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		t.Cleanup(h.Close)
		addrs[name] = strings.TrimPrefix(h.URL, "http://")
		return m
	}
	lookup := kvstore.Instrument(store, serve("lookup"), kvstore.OpNames{Exists: "lookup_exists"}).
		WithLabels(kvstore.VLLMLabels{ModelName: model})
	sender := kvstore.Instrument(store, serve("sender"), kvstore.OpNames{Exists: "save_exists"}).
		WithLabels(kvstore.VLLMLabels{ModelName: model})
	serve("scheduler") // serves no store family
	dm := serve("gpuworker")
	decodeGet := kvstore.Instrument(store, dm, kvstore.OpNames{Get: "load_get"}).WithLabels(kvstore.VLLMLabels{ModelName: model, Engine: "decode-0"})
	kvstore.Instrument(store, dm, kvstore.OpNames{Put: "save_put"}).WithLabels(kvstore.VLLMLabels{ModelName: model, Engine: "decode-0"})
	pm := serve("gpuworker-prefill")
	prefillPut := kvstore.Instrument(store, pm, kvstore.OpNames{Put: "save_put"}).WithLabels(kvstore.VLLMLabels{ModelName: model, Engine: "prefill-0"})
	kvstore.Instrument(store, pm, kvstore.OpNames{Get: "load_get"}).WithLabels(kvstore.VLLMLabels{ModelName: model, Engine: "prefill-0"})

	prom := testenv.StartPrometheus(t, prometheusConfigFor(t, root, addrs))
	waitScrapes(ctx, t, prom, len(addrs), time.Time{})

	key := func(i int) string {
		return fmt.Sprintf("vllm-prom-test-%d-%d@%s@tp_rank:0@group:0", time.Now().UnixNano(), i, model)
	}
	k := []string{key(0), key(1), key(2)}
	decode := kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: "decode-0"})
	prefill := kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: "prefill-0"})
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	_, err = lookup.Exists(decode, k)
	must("lookup_exists", err)
	_, err = sender.Exists(prefill, k)
	must("save_exists", err)
	_, err = prefillPut.Put(ctx, []kvstore.Item{{Key: k[0], Value: []byte("abcd")}, {Key: k[1], Value: []byte("too large!")}}) // partial_failure
	must("save_put", err)
	_, _, err = decodeGet.Get(ctx, k[:2]) // k[1] was refused: partial_failure
	must("load_get", err)
	// Scraped before the failures, the error series (created at 0 by each
	// engine's first call) show the failures as increases.
	waitScrapes(ctx, t, prom, len(addrs), time.Now())
	srv.Stop()
	if _, err := lookup.Exists(decode, k); err == nil {
		t.Fatal("lookup_exists with redis-server stopped succeeded")
	}
	if _, err := sender.Exists(prefill, k); err == nil {
		t.Fatal("save_exists with redis-server stopped succeeded")
	}
	waitScrapes(ctx, t, prom, len(addrs), time.Now())

	// What was driven, by operation and status: operations and failed keys.
	want := map[string][2]float64{
		"lookup_exists/ok": {1, 0}, "lookup_exists/error": {1, 3},
		"save_exists/ok": {1, 0}, "save_exists/error": {1, 3},
		"save_put/partial_failure": {1, 1}, "save_put/ok": {0, 0}, "save_put/error": {0, 0},
		"load_get/partial_failure": {1, 1}, "load_get/ok": {0, 0}, "load_get/error": {0, 0},
	}
	calls := promVector(ctx, t, prom, `sum by (operation, status) (vllm:mooncake_store_operation_total)`, "operation", "status")
	failed := promVector(ctx, t, prom, `sum by (operation, status) (vllm:mooncake_store_operation_failed_keys_total)`, "operation", "status")
	for k, w := range want {
		if calls[k] != w[0] || failed[k] != w[1] {
			t.Errorf("%s: %v operations, %v failed keys in Prometheus; want %v, %v", k, calls[k], failed[k], w[0], w[1])
		}
	}
	if len(calls) != len(want) {
		t.Errorf("Prometheus holds operation series %v, want %v", calls, want)
	}
	engines := promVector(ctx, t, prom, `sum by (engine, operation) (vllm:mooncake_store_operation_total)`, "engine", "operation")
	for _, k := range []string{"decode-0/lookup_exists", "prefill-0/save_exists", "prefill-0/save_put", "decode-0/load_get"} {
		if engines[k] == 0 {
			t.Errorf("no operations under engine/operation %s in Prometheus: %v", k, engines)
		}
	}

	dashboards, err := deploy.LoadDashboards(root)
	if err != nil {
		t.Fatal(err)
	}
	vars := strings.NewReplacer("$__rate_interval", "1m", "$__range", "5m", "$engine", ".*")
	n := 0
	for _, d := range dashboards {
		for _, p := range d.AllPanels() {
			for _, tg := range p.Targets {
				if !slices.ContainsFunc(deploy.MetricNames(tg.Expr), func(m string) bool { return strings.HasPrefix(m, "vllm:") }) {
					continue
				}
				n++
				res, err := prom.Query(ctx, vars.Replace(tg.Expr))
				switch {
				case err != nil:
					t.Errorf("%s / %q: %v", d.File, p.Title, err)
				case len(res.Series) == 0:
					t.Errorf("%s / %q: %s returned no series", d.File, p.Title, tg.Expr)
				}
			}
		}
	}
	if n < 5 {
		t.Errorf("the dashboards hold %d expressions of vllm: families, want the store, GPU worker and overview panels", n)
	}

	doc, err := os.ReadFile(filepath.Join(root, "docs", "observability.md"))
	if err != nil {
		t.Fatal(err)
	}
	oneLine := func(s string) string { return strings.Join(strings.Fields(s), " ") }
	if !strings.Contains(oneLine(string(doc)), oneLine(vllmAlertExpr)) {
		t.Errorf("docs/observability.md does not hold the alert example:\n%s", vllmAlertExpr)
	}
	alert := promVector(ctx, t, prom, vllmAlertExpr, "operation")
	for _, op := range []string{"lookup_exists", "save_exists", "save_put", "load_get"} {
		if alert[op] <= 0.05 {
			t.Errorf("alert example: %s not firing after its failures (%v)", op, alert)
		}
	}
}

// prometheusConfigFor returns deploy/prometheus.yml with its targets
// (compose service names) replaced by addrs[service] and every interval
// set to 1 s.
func prometheusConfigFor(t *testing.T, root string, addrs map[string]string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, deploy.PrometheusFile))
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := deploy.RetargetPrometheus(data, "1s", func(host string) (string, bool) {
		a, ok := addrs[host]
		return a, ok && a != ""
	})
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// waitScrapes polls Prometheus until it has n targets, each up and scraped
// twice after since.
func waitScrapes(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, n int, since time.Time) {
	t.Helper()
	seen := map[string]map[time.Time]bool{}
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		ts, err := prom.Targets(ctx)
		done := err == nil && len(ts) == n
		last = fmt.Sprint(err)
		for _, tg := range ts {
			if tg.LastScrape.After(since) && tg.Health == "up" {
				if seen[tg.ScrapeURL] == nil {
					seen[tg.ScrapeURL] = map[time.Time]bool{}
				}
				seen[tg.ScrapeURL][tg.LastScrape] = true
			}
			done = done && len(seen[tg.ScrapeURL]) >= 2
			last += fmt.Sprintf("; %s %s %q", tg.ScrapeURL, tg.Health, tg.LastError)
		}
		if done {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatalf("prometheus did not scrape %d targets twice: %s\n%s", n, last, prom.Output())
}

// promVector evaluates expr and returns its series' values keyed by the
// values of labels joined with "/".
func promVector(ctx context.Context, t *testing.T, prom *testenv.PrometheusServer, expr string, labels ...string) map[string]float64 {
	t.Helper()
	res, err := prom.Query(ctx, expr)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, s := range res.Series {
		var parts []string
		for _, l := range labels {
			parts = append(parts, s.Metric[l])
		}
		if len(s.Value) != 2 {
			t.Fatalf("%s: series %v has no instant value", expr, s.Metric)
		}
		v, err := strconv.ParseFloat(fmt.Sprint(s.Value[1]), 64)
		if err != nil {
			t.Fatalf("%s: %v", expr, err)
		}
		out[strings.Join(parts, "/")] = v
	}
	return out
}
