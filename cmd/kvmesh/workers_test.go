package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

func testWorkers(t *testing.T, s *cliStack) {
	// A worker whose heartbeat is an hour old: listed stale, its pool not read.
	dbURL := ""
	for _, e := range s.common {
		if v, ok := strings.CutPrefix(e, "KVMESH_DATABASE_URL="); ok {
			dbURL = v
		}
	}
	ctx := context.Background()
	pool, err := database.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := registry.Register(ctx, pool, registry.Worker{EngineID: "cli-gone", Addr: "http://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE engine_id = 'cli-gone'`); err != nil {
		t.Fatal(err)
	}

	r := runCLI(t, append([]string{"workers"}, s.flags()...)...).ok(t)
	rows := r.rows()
	if len(rows) != 3 {
		t.Fatalf("workers: %d rows, want cli-e1, cli-gone and cli-late", len(rows))
	}
	want := map[string][]string{
		cliEngine:     {"tp0-pcp0-dcp0-pp0", s.url("gpuworker"), "alive"},
		"cli-gone":    {"tp0-pcp0-dcp0-pp0", "http://127.0.0.1:1", "stale"},
		cliLateEngine: {"tp0-pcp0-dcp0-pp0", s.url("gpuworker-late"), "alive"},
	}
	for _, f := range rows {
		w, ok := want[f[0]]
		if !ok || f[1] != w[0] || f[2] != w[1] || f[3] != w[2] {
			t.Errorf("row %q, want %q", f, w)
		}
		// ENGINE RANK ADDR STATE <age>s ago POOL…
		pool := strings.Join(f[6:], " ")
		switch {
		case f[3] == "stale" && pool != "-":
			t.Errorf("stale worker's pool %q, want -", pool)
		case f[3] == "alive" && !strings.HasSuffix(pool, "/128 blocks in use"):
			t.Errorf("alive worker's pool %q, want n/128 blocks in use", pool)
		}
	}
	js := runCLI(t, append([]string{"workers", "--state", "alive", "--json"}, s.flags()...)...).ok(t)
	var p page[worker]
	if err := json.Unmarshal([]byte(js.stdout), &p); err != nil || len(p.Items) != 2 || p.Items[0].Pool == nil || p.Items[0].Pool.Blocks != 128 {
		t.Fatalf("workers --state alive --json: %v %+v", err, p)
	}
	if one := runCLI(t, append([]string{"workers", "--engine", cliLateEngine}, s.flags()...)...).ok(t); len(one.rows()) != 1 {
		t.Fatalf("--engine %s: want one row", cliLateEngine)
	}
}
