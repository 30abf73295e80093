package testenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Errors of StartPrometheus and the PrometheusServer methods.
var (
	// ErrPrometheusAPI reports an HTTP API answer whose status is not
	// "success" (for a query: one that does not parse or cannot be
	// evaluated).
	ErrPrometheusAPI = errors.New("prometheus API error")
)

// PrometheusServer is a private Prometheus that StartPrometheus started for
// one test: its configuration and TSDB in the test's temporary directory,
// its web API on 127.0.0.1 on a port of its own.
type PrometheusServer struct {
	*serverProcess
	hc *http.Client
}

// StartPrometheus writes config (a prometheus.yml) to a temporary directory,
// starts `prometheus --config.file=<it> --storage.tsdb.path=<dir>
// --web.listen-address=127.0.0.1:N` followed by args, waits until it answers
// /-/ready, and kills it when the test ends. Without prometheus on PATH (the
// Debian package prometheus, which scripts/devstack.sh installs) the test is
// skipped, or fails when KVMESH_REQUIRE_SERVICES=1. Prometheus hands new
// targets to its scrapers at most every 5 s, so a test waits for its
// targets (Targets) rather than assuming they are scraped at once.
func StartPrometheus(t testing.TB, config string, args ...string) *PrometheusServer {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		unavailable(t, "prometheus is not on PATH (%v); install the Debian package prometheus (scripts/devstack.sh up does, as root)", err)
	}
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, []byte(config), 0o644); err != nil {
		t.Fatalf("write prometheus config: %v", err)
	}
	hc := &http.Client{Timeout: 5 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	launch := func(attempt int) (*serverProcess, error) {
		addr, err := freeAddr()
		if err != nil {
			return nil, err
		}
		return launchServer("prometheus", bin, addr, append([]string{
			"--config.file=" + cfg,
			"--storage.tsdb.path=" + filepath.Join(dir, fmt.Sprintf("data-%d", attempt)),
			"--web.listen-address=" + addr,
		}, args...))
	}
	ready := func(p *serverProcess) error { return (&PrometheusServer{p, hc}).ready() }
	return &PrometheusServer{startServer(t, launch, ready), hc}
}

// URL returns the server's base URL (http://127.0.0.1:N).
func (s *PrometheusServer) URL() string {
	return "http://" + s.addr
}

// ready asks /-/ready once.
func (s *PrometheusServer) ready() error {
	resp, err := s.hc.Get(s.URL() + "/-/ready")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/-/ready: %s", resp.Status)
	}
	return nil
}

// PromTarget is one active scrape target, as /api/v1/targets reports it.
type PromTarget struct {
	// ScrapePool is the job the target belongs to.
	ScrapePool string `json:"scrapePool"`
	// ScrapeURL is the URL Prometheus scrapes.
	ScrapeURL string `json:"scrapeUrl"`
	// Labels are the target's labels after relabelling (job, instance, ...).
	Labels map[string]string `json:"labels"`
	// Health is "up", "down" or "unknown" (not scraped yet).
	Health string `json:"health"`
	// LastError is the last scrape's error; empty when it succeeded.
	LastError string `json:"lastError"`
	// LastScrape is when the last scrape started.
	LastScrape time.Time `json:"lastScrape"`
}

// Targets returns the server's active scrape targets.
func (s *PrometheusServer) Targets(ctx context.Context) ([]PromTarget, error) {
	var data struct {
		ActiveTargets []PromTarget `json:"activeTargets"`
	}
	if err := s.api(ctx, "/api/v1/targets?state=active", &data); err != nil {
		return nil, err
	}
	return data.ActiveTargets, nil
}

// PromSeries is one series of a query's vector or matrix result.
type PromSeries struct {
	// Metric are the series' labels.
	Metric map[string]string `json:"metric"`
	// Value is an instant vector's [unix time, "value"].
	Value []any `json:"value"`
	// Values are a range vector's [unix time, "value"] pairs.
	Values [][]any `json:"values"`
}

// PromResult is the data of a successful /api/v1/query answer.
type PromResult struct {
	// ResultType is vector, matrix, scalar or string.
	ResultType string
	// Series are a vector's or matrix's series; empty for scalar and string.
	Series []PromSeries
	// Warnings are the server's warnings about the query.
	Warnings []string
}

// Query evaluates expr at the current time through /api/v1/query. An
// expression the server rejects (a parse or evaluation error) is an error
// naming the server's errorType and message.
func (s *PrometheusServer) Query(ctx context.Context, expr string) (*PromResult, error) {
	var data struct {
		ResultType string          `json:"resultType"`
		Result     json.RawMessage `json:"result"`
	}
	var warnings []string
	if err := s.apiWarn(ctx, "/api/v1/query?query="+url.QueryEscape(expr), &data, &warnings); err != nil {
		return nil, fmt.Errorf("query %q: %w", expr, err)
	}
	r := &PromResult{ResultType: data.ResultType, Warnings: warnings}
	if data.ResultType == "vector" || data.ResultType == "matrix" {
		if err := json.Unmarshal(data.Result, &r.Series); err != nil {
			return nil, fmt.Errorf("query %q: decode %s result: %w", expr, data.ResultType, err)
		}
	}
	return r, nil
}

// api GETs path from the HTTP API and decodes its data into v.
func (s *PrometheusServer) api(ctx context.Context, path string, v any) error {
	return s.apiWarn(ctx, path, v, nil)
}

// apiWarn is api that also returns the answer's warnings.
func (s *PrometheusServer) apiWarn(ctx context.Context, path string, v any, warnings *[]string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL()+path, nil)
	if err != nil {
		return fmt.Errorf("prometheus API: %w", err)
	}
	resp, err := s.hc.Do(req)
	if err != nil {
		return fmt.Errorf("prometheus API: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("prometheus API %s: read: %w", path, err)
	}
	var env struct {
		Status    string          `json:"status"`
		Data      json.RawMessage `json:"data"`
		ErrorType string          `json:"errorType"`
		Error     string          `json:"error"`
		Warnings  []string        `json:"warnings"`
	}
	if err := json.Unmarshal(body, &env); err != nil {
		return fmt.Errorf("prometheus API %s: %s: decode: %w: %s", path, resp.Status, err, strings.TrimSpace(string(body)))
	}
	if env.Status != "success" {
		return fmt.Errorf("%w: %s: %s (%s)", ErrPrometheusAPI, env.ErrorType, env.Error, resp.Status)
	}
	if warnings != nil {
		*warnings = env.Warnings
	}
	if err := json.Unmarshal(env.Data, v); err != nil {
		return fmt.Errorf("prometheus API %s: decode data: %w", path, err)
	}
	return nil
}
