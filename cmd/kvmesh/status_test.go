package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

func testStatus(t *testing.T, s *cliStack) {
	flags := append(s.flags(), "--gpuworker-url", s.url("gpuworker-late"))
	r := runCLI(t, append([]string{"status"}, flags...)...).ok(t)
	rows := r.rows()
	if len(rows) != 5 {
		t.Fatalf("status: %d rows, want lookup, scheduler, sender and two gpuworkers", len(rows))
	}
	for i, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker"} {
		if rows[i][0] != name || rows[i][2] != "yes" {
			t.Errorf("row %d = %q, want %s ready", i, rows[i], name)
		}
	}
	for _, want := range []string{"dead_letters=8", "trackers.waiting=3", "outbox_backlog=", "pool_blocks=128", "requests="} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("status lacks %q", want)
		}
	}

	js := runCLI(t, append([]string{"status", "--json"}, s.flags()...)...).ok(t)
	var got []serviceStatus
	if err := json.Unmarshal([]byte(js.stdout), &got); err != nil || len(got) != 4 {
		t.Fatalf("status --json: %v %+v", err, got)
	}
	for _, row := range got {
		if !row.Ready || row.MetricsError != "" || len(row.Counters) == 0 {
			t.Errorf("status --json row %+v", row)
		}
	}

	// A lookup whose store went away stays ready (it fails open and
	// answers 0 tokens) but is degraded, and status says so and fails.
	private := testenv.StartRedis(t)
	s.start("lookup-private", "lookup", "KVMESH_REDIS_URL="+private.URL())
	if t.Failed() {
		t.FailNow()
	}
	private.Stop()
	bad := append(s.flags(), "--lookup-url", s.url("lookup-private"))
	down := runCLI(t, append([]string{"status"}, bad...)...).fails(t, "not every service is healthy: 1 of 4 degraded")
	if !strings.Contains(down.stdout, "degraded: store: ") {
		t.Fatalf("status of the lookup without its store: want the degraded check:\n%s", down.stdout)
	}

	gone := append(s.flags(), "--gpuworker-url", "http://127.0.0.1:1")
	unreachable := runCLI(t, append([]string{"status"}, gone...)...).fails(t, "1 of 5 not ready") // a repeated --gpuworker-url adds a worker
	if !strings.Contains(unreachable.stdout, "gpuworker at http://127.0.0.1:1 is not reachable") ||
		!strings.Contains(unreachable.stdout, "set --gpuworker-url or KVMESH_GPUWORKER_URL") {
		t.Fatalf("status of an unreachable worker: want the URL and the flag to fix it")
	}
}
