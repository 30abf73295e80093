package app_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/service/servicetest"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// startForAPI runs a sender on a fresh env for the route tests.
func startForAPI(t *testing.T) *app.App {
	t.Helper()
	env := servicetest.NewEnv(t)
	cfg := app.Config{
		Common: env.Common(), HTTPAddr: "127.0.0.1:0", DatabaseURL: env.DatabaseURL, RedisURL: env.RedisURL,
		Consumers: 1, RetryAttempts: 1, RetryBase: 10 * time.Millisecond, RetryMax: 10 * time.Millisecond,
		ProbeEvery: 1, PressureCoolDown: time.Second, WorkerStaleAfter: 30 * time.Second,
		StoreTimeout: time.Second, PutTimeout: time.Second,
	}
	a, err := app.New(context.Background(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, a.Run)
	servicetest.WaitReady(t, a.Addr())
	return a
}

// TestOpenAPIMatchesRoutes: the document served at /openapi.yaml is the
// embedded one and documents exactly the routes the router serves.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	a := startForAPI(t)
	servicetest.CheckServedOpenAPI(t, a.Addr(), a.Routes(), app.OpenAPI)
}
