package app_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// startApp runs the service on a fresh env and waits until it is ready.
func startApp(t *testing.T) *app.App {
	t.Helper()
	env := servicetest.NewEnv(t)
	cfg := app.Config{Common: env.Common(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Database: service.Database{DatabaseURL: env.DatabaseURL}, Consumers: 1, Migrate: true}
	cfg.LogLevel = "warn"
	a, err := app.New(context.Background(), cfg, testLogger())
	return servicetest.StartReady(t, a, err)
}

func TestStartsReadyAndStops(t *testing.T) {
	startApp(t) // fails unless ready, and unless it stops in time at cleanup
}

func TestREADMEConfig(t *testing.T) {
	servicetest.CheckConfigDoc(t, "scheduler", &app.Config{})
}

func TestConfigValidate(t *testing.T) {
	valid := func() app.Config {
		return app.Config{Common: (&servicetest.Env{Brokers: []string{"127.0.0.1:1"}}).Common(), TrackerRetention: time.Hour,
			TrackerIdleTimeout: 24 * time.Hour, Consumers: 4, BatchSize: 256, MaintenanceInterval: time.Second,
			LoadRankTimeout: 30 * time.Second}
	}
	tests := []struct {
		name   string
		mutate func(*app.Config)
		want   string // substring of the error; "" = valid
	}{
		{"valid", func(*app.Config) {}, ""},
		{"no retention", func(c *app.Config) { c.TrackerRetention = 0 }, "KVMESH_TRACKER_RETENTION"},
		{"idle below retention", func(c *app.Config) { c.TrackerIdleTimeout = time.Minute }, "KVMESH_TRACKER_IDLE_TIMEOUT"},
		{"no consumers", func(c *app.Config) { c.Consumers = 0 }, "KVMESH_SCHEDULER_CONSUMERS"},
		{"too many consumers", func(c *app.Config) { c.Consumers = app.MaxConsumers + 1 }, "KVMESH_SCHEDULER_CONSUMERS"},
		{"tiny session", func(c *app.Config) { c.SessionTimeout = time.Millisecond }, "KVMESH_KAFKA_SESSION_TIMEOUT"},
		{"no batch", func(c *app.Config) { c.BatchSize = 0 }, "KVMESH_SCHEDULER_BATCH"},
		{"huge batch", func(c *app.Config) { c.BatchSize = app.MaxBatchSize + 1 }, "KVMESH_SCHEDULER_BATCH"},
		{"no maintenance interval", func(c *app.Config) { c.MaintenanceInterval = 0 }, "KVMESH_MAINTENANCE_INTERVAL"},
		{"no load rank timeout", func(c *app.Config) { c.LoadRankTimeout = 0 }, "KVMESH_LOAD_RANK_TIMEOUT"},
		{"negative load rank timeout", func(c *app.Config) { c.LoadRankTimeout = -time.Second }, "KVMESH_LOAD_RANK_TIMEOUT"},
		{"common settings too", func(c *app.Config) { c.Brokers = nil }, "KVMESH_KAFKA_BROKERS"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := valid()
			tt.mutate(&c)
			err := c.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one naming %s", err, tt.want)
			}
		})
	}
}
