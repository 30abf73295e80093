package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

// TestRemovalsCommand: kvmesh removals asks the sender's GET /v1/removals
// with the window, cause, limit and — only when -tenant is given — the
// tenant, and prints the causes and the newest records; --json prints the
// answer.
func TestRemovalsCommand(t *testing.T) {
	var mu sync.Mutex
	var queries []string
	tenant, avg := "acme", 60.0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		queries = append(queries, r.URL.RawQuery)
		mu.Unlock()
		if r.URL.Path != "/v1/removals" || r.Header.Get("Authorization") != "Bearer tok" {
			http.Error(w, "no", http.StatusNotFound)
			return
		}
		at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
		_ = json.NewEncoder(w).Encode(adminapi.Removals{Tenant: &tenant, Since: at.Add(-time.Hour), Until: at,
			ByCause: []adminapi.RemovalCause{{Cause: "evicted", Blocks: 2, AgesKnown: 2, AgeMinS: &avg, AgeAvgS: &avg, AgeMaxS: &avg}},
			Recent:  []adminapi.Removal{{RemovedAt: at, Tenant: "acme", Cause: "evicted", Blocks: 2, AgesKnown: 2, Namespace: "dep@m@ns"}}})
	}))
	defer srv.Close()
	flags := []string{"--sender-url", srv.URL, "--token", "tok"}
	out := runCLI(t, append([]string{"removals", "-tenant", "acme", "-cause", "evicted", "-since", "2h"}, flags...)...).ok(t)
	if !strings.Contains(out.stdout, `removals of tenant "acme"`) || !strings.Contains(out.stdout, "60.0s") || !strings.Contains(out.stdout, "dep@m@ns") {
		t.Errorf("stdout %q: want the tenant, the ages and the record", out.stdout)
	}
	runCLI(t, append([]string{"removals", "-tenant="}, flags...)...).ok(t)
	runCLI(t, append([]string{"removals", "--json"}, flags...)...).ok(t)
	mu.Lock()
	defer mu.Unlock()
	want := []string{"cause=evicted&limit=20&since=2h&tenant=acme", "limit=20&since=1h&tenant=", "limit=20&since=1h"}
	if strings.Join(queries, " ") != strings.Join(want, " ") {
		t.Errorf("queries %q, want %q", queries, want)
	}
}
