package app_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestStartsReadyRegistersAndStops(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-ready")
	w := startWorker(t, cfg, nil)

	pool, err := database.Connect(context.Background(), env.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ws, err := registry.Find(context.Background(), pool, "engine-ready", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(ws) != 1 || ws[0].Addr != "http://"+w.app.Addr() || ws[0].Rank != cfg.Rank() {
		t.Fatalf("registry = %+v, want one worker at http://%s", ws, w.app.Addr())
	}
	if !strings.Contains(string(ws[0].Devices), `"devices"`) {
		t.Fatalf("registered devices = %s, want the inventory", ws[0].Devices)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	tests := []struct {
		name   string
		mutate func(*app.Config)
		want   string
	}{
		{"no engine", func(c *app.Config) { c.EngineID = " " }, "KVMESH_ENGINE_ID"},
		{"negative rank", func(c *app.Config) { c.RankTP = -1 }, "KVMESH_RANK_"},
		{"empty pool", func(c *app.Config) { c.PoolBlocks = 0 }, "KVMESH_POOL_BLOCKS"},
		{"tiny batch", func(c *app.Config) { c.MaxBatchBytes = 1000 }, "KVMESH_MAX_BATCH_BYTES"},
		{"stale before heartbeat", func(c *app.Config) { c.WorkerStaleAfter = c.HeartbeatInterval }, "KVMESH_HEARTBEAT_INTERVAL"},
		{"events form", func(c *app.Config) { c.KVEventsForm = "list" }, "KVMESH_KV_EVENTS_FORM"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(env, "engine")
			tc.mutate(&cfg)
			err := cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want an error naming %s", err, tc.want)
			}
			if _, err := app.New(context.Background(), cfg, nil); err == nil {
				t.Fatal("New accepted an invalid configuration")
			}
		})
	}
}

func TestREADMEConfig(t *testing.T) {
	servicetest.CheckConfigDoc(t, "gpuworker", &app.Config{})
}
