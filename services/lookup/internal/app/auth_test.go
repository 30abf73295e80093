package app_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

// TestAdminRoutesRequireToken: the lookup has no admin route; with
// authentication required its one mutating route, POST /v1/lookup (the
// engine API), answers 401 without a token or with a wrong one and 403 to
// the operator token, which is no engine's.
func TestAdminRoutesRequireToken(t *testing.T) {
	env := servicetest.NewEnv(t)
	cfg := app.Config{Common: env.SecuredCommon(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Store: service.Store{RedisURL: env.RedisURL}, Enabled: true}
	cfg.KeyPrefix = randomID("auth-")
	a, err := app.New(context.Background(), cfg, slog.New(slog.DiscardHandler))
	a = servicetest.StartReady(t, a, err)
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, "http://"+a.Addr(), "test-token", a.Routes(), d, nil)
}
