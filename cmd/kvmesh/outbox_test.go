package main

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/database"
)

// fakeOutboxScheduler serves GET /v1/outbox/failed (two pages of one row)
// and POST /v1/outbox/{id}/retry (1 retried, 2 not failed, others unknown;
// token "tok") and records the retries it was asked for.
type fakeOutboxScheduler struct {
	mu      sync.Mutex
	retried []string
}

func (f *fakeOutboxScheduler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	problem := func(status int, detail string) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]any{"type": "about:blank", "title": http.StatusText(status), "status": status, "detail": detail})
	}
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/v1/outbox/failed":
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Query().Get("cursor") == "" {
			_, _ = w.Write([]byte(`{"items":[{"id":1,"topic":"kvmesh.save.dlq","key":"r1","value_bytes":1228800,"attempts":1,"reason":"message_too_large","failed_at":"2026-09-01T12:00:00Z"}],"next_cursor":"c2"}`))
			return
		}
		_, _ = w.Write([]byte(`{"items":[{"id":7,"topic":"kvmesh.load.tasks","key":"r2","value_bytes":10,"attempts":2,"reason":"invalid_topic","failed_at":"2026-09-01T12:00:01Z"}]}`))
	case r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/outbox/"):
		if r.Header.Get("Authorization") != "Bearer tok" {
			problem(http.StatusUnauthorized, "admin token required")
			return
		}
		id := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/v1/outbox/"), "/retry")
		f.mu.Lock()
		f.retried = append(f.retried, id)
		f.mu.Unlock()
		switch id {
		case "1":
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"id":1,"status":"pending"}`))
		case "2":
			problem(http.StatusConflict, "outbox row 2 is not failed (pending or sent)")
		default:
			problem(http.StatusNotFound, "no outbox row "+id)
		}
	default:
		problem(http.StatusNotFound, "no route")
	}
}

func TestOutboxCommands(t *testing.T) {
	fake := &fakeOutboxScheduler{}
	srv := httptest.NewServer(fake)
	defer srv.Close()
	flags := []string{"--scheduler-url", srv.URL, "--token", "tok"}

	list := runCLI(t, append([]string{"outbox", "failed"}, flags...)...).ok(t)
	if rows := list.rows(); len(rows) != 1 || rows[0][0] != "1" || rows[0][len(rows[0])-1] != "message_too_large" ||
		!strings.Contains(list.stdout, "next cursor: c2") {
		t.Errorf("outbox failed rows %q, stdout %q; want row 1 and the next cursor", rows, list.stdout)
	}
	all := runCLI(t, append([]string{"outbox", "failed", "--all", "--json"}, flags...)...).ok(t)
	var p page[database.FailedRow]
	if err := json.Unmarshal([]byte(all.stdout), &p); err != nil || len(p.Items) != 2 || p.Items[1].ID != 7 {
		t.Errorf("outbox failed --all --json: %v %+v; want rows 1 and 7", err, p)
	}

	ok := runCLI(t, append([]string{"outbox", "retry", "1"}, flags...)...).ok(t)
	if rows := ok.rows(); len(rows) != 1 || rows[0][1] != "pending" {
		t.Errorf("outbox retry 1 rows %q, want pending", rows)
	}
	bad := runCLI(t, append([]string{"outbox", "retry", "2", "9"}, flags...)...).fails(t, "2 of 2 rows not retried")
	if !strings.Contains(bad.stdout, "not failed") || !strings.Contains(bad.stdout, "not found") {
		t.Errorf("outbox retry 2 9 stdout %q, want not failed and not found", bad.stdout)
	}
	runCLI(t, "outbox", "retry", "1", "--scheduler-url", srv.URL, "--token", "").fails(t, "Unauthorized")
	for _, args := range [][]string{{"outbox"}, {"outbox", "purge"}, {"outbox", "retry"}, {"outbox", "retry", "x"}, {"outbox", "failed", "extra"}} {
		if r := runCLI(t, args...); r.code != 2 {
			t.Errorf("kvmesh %q exit %d, want 2 (usage)", args, r.code)
		}
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if strings.Join(fake.retried, ",") != "1,2,9" {
		t.Errorf("retries sent %v, want 1, 2, 9 (none without a token)", fake.retried)
	}
}
