package testenv_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// TestStartPrometheusScrapesAndQueries starts a Prometheus that scrapes a
// test server every 100 ms, waits until its target is up, and checks Query:
// a selector returns the served series, a broken expression is an
// ErrPrometheusAPI, and Stop takes the server away.
func TestStartPrometheusScrapesAndQueries(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "# TYPE kvmesh_test_value gauge\nkvmesh_test_value{kind=\"x\"} 7\n")
	}))
	defer srv.Close()
	target := strings.TrimPrefix(srv.URL, "http://")
	p := testenv.StartPrometheus(t, fmt.Sprintf(`
global: {scrape_interval: 100ms, scrape_timeout: 100ms}
scrape_configs:
  - job_name: test
    static_configs: [{targets: [%q]}]
`, target))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var res *testenv.PromResult
	for {
		var err error
		if res, err = p.Query(ctx, `kvmesh_test_value{job="test"}`); err != nil {
			t.Fatal(err)
		}
		if len(res.Series) > 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no series scraped from %s:\n%s", target, p.Output())
		case <-time.After(50 * time.Millisecond):
		}
	}
	if res.ResultType != "vector" || len(res.Series) != 1 || res.Series[0].Metric["instance"] != target ||
		res.Series[0].Metric["kind"] != "x" || fmt.Sprint(res.Series[0].Value[1]) != "7" {
		t.Errorf("kvmesh_test_value = %+v, want one series of %s, kind x, at 7", res, target)
	}
	ts, err := p.Targets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 1 || ts[0].ScrapePool != "test" || ts[0].Health != "up" || ts[0].LastScrape.IsZero() {
		t.Errorf("targets %+v, want the test target up", ts)
	}
	res, err = p.Query(ctx, "scalar(vector(2))")
	if err != nil || res.ResultType != "scalar" || len(res.Series) != 0 {
		t.Errorf("scalar query = %+v, %v; want a scalar without series", res, err)
	}
	if _, err := p.Query(ctx, "sum(up"); !errors.Is(err, testenv.ErrPrometheusAPI) {
		t.Errorf("broken expression: err %v, want ErrPrometheusAPI", err)
	}

	p.Stop()
	p.Stop() // idempotent, as is the call at cleanup
	if resp, err := http.Get(p.URL() + "/-/ready"); err == nil {
		resp.Body.Close()
		t.Error("/-/ready answered after Stop")
	}
}

func TestStartPrometheusSkipsWithoutBinary(t *testing.T) {
	t.Setenv("KVMESH_REQUIRE_SERVICES", "")
	t.Setenv("PATH", t.TempDir())
	var sub *testing.T
	t.Run("no prometheus", func(t *testing.T) {
		sub = t
		testenv.StartPrometheus(t, "")
		t.Error("StartPrometheus returned without prometheus on PATH")
	})
	if !sub.Skipped() {
		t.Error("test without prometheus was not skipped")
	}
}
