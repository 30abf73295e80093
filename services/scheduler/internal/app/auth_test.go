package app_test

import (
	"context"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// TestAdminRoutesRequireToken: with authentication required, the
// scheduler's admin API (its reads and the outbox retry) answers 401
// without a token or with a wrong one and runs with the operator token; a
// mutating route added without being secured in the document fails this
// test.
func TestAdminRoutesRequireToken(t *testing.T) {
	env := servicetest.NewEnv(t)
	cfg := app.Config{Common: env.SecuredCommon(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Database: service.Database{DatabaseURL: env.DatabaseURL}, Consumers: 1, Migrate: true}
	cfg.LogLevel = "warn"
	a, err := app.New(context.Background(), cfg, testLogger())
	a = servicetest.StartReady(t, a, err)
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, "http://"+a.Addr(), "test-token", a.Routes(), d, nil)
}
