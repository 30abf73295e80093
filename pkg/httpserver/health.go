package httpserver

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Readiness statuses reported by GET /readyz.
const (
	StatusOK     = "ok"
	StatusFailed = "failed"
)

// CheckResult is the outcome of one ReadyCheck in the /readyz report.
type CheckResult struct {
	// Status is StatusOK or StatusFailed.
	Status string `json:"status"`
	// Error is the check's error when it failed.
	Error string `json:"error,omitempty"`
}

// mountBuiltin adds the health, readiness and metrics routes.
func (s *Server) mountBuiltin() {
	s.mux.Get(PathHealth, s.health)
	s.mux.Get(PathReady, s.ready)
	s.mux.Method(http.MethodGet, PathMetrics,
		promhttp.HandlerFor(s.opts.Registry, promhttp.HandlerOpts{}))
}

// health answers 200 while the process serves requests.
func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	_ = WriteJSON(w, http.StatusOK, map[string]string{"status": StatusOK, "service": s.opts.Service}) // a fixed map always encodes.
}

// ready runs every check and answers 200 with each result, or a 503 problem
// naming the failed checks. A failed Optional check does not make the
// service unready: it is listed in the body's degraded member (200 or 503).
func (s *Server) ready(w http.ResponseWriter, r *http.Request) {
	results := s.runChecks(r.Context())
	var failed, degraded []string
	for _, c := range s.opts.Ready {
		switch {
		case results[c.Name].Status == StatusOK:
		case c.Optional:
			degraded = append(degraded, c.Name)
		default:
			failed = append(failed, c.Name)
		}
	}
	sort.Strings(degraded)
	if len(failed) == 0 {
		body := map[string]any{"status": "ready", "service": s.opts.Service, "checks": results}
		if len(degraded) > 0 {
			body["degraded"] = degraded
		}
		_ = WriteJSON(w, http.StatusOK, body) // strings only: always encodes.
		return
	}
	sort.Strings(failed)
	extras := map[string]any{"failed": failed, "checks": results}
	if len(degraded) > 0 {
		extras["degraded"] = degraded
	}
	WriteProblem(w, r, http.StatusServiceUnavailable, "Not Ready",
		"failed readiness checks: "+strings.Join(failed, ", "), extras)
}

// runChecks runs the ready checks concurrently, each under ReadyTimeout.
func (s *Server) runChecks(ctx context.Context) map[string]CheckResult {
	results := make(map[string]CheckResult, len(s.opts.Ready))
	var (
		mu sync.Mutex
		wg sync.WaitGroup
	)
	for _, c := range s.opts.Ready {
		wg.Go(func() {
			res := runCheck(ctx, c, s.opts.ReadyTimeout)
			mu.Lock()
			results[c.Name] = res
			mu.Unlock()
		})
	}
	wg.Wait()
	return results
}

// runCheck runs one check under timeout. A check that ignores its context
// is reported failed at the deadline and left to finish on its own.
func runCheck(ctx context.Context, c ReadyCheck, timeout time.Duration) CheckResult {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Check(cctx) }()
	var err error
	select {
	case err = <-done:
	case <-cctx.Done():
		err = fmt.Errorf("no answer within %s: %w", timeout, cctx.Err())
	}
	if err != nil {
		return CheckResult{Status: StatusFailed, Error: err.Error()}
	}
	return CheckResult{Status: StatusOK}
}
