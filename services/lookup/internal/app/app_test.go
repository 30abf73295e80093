package app_test

import (
	"context"
	"log/slog"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/pkg/service/servicetest"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestStartsReadyAndStops(t *testing.T) {
	env := servicetest.NewEnv(t)
	cfg := app.Config{
		Common:   env.Common(),
		HTTPAddr: "127.0.0.1:0",
		RedisURL: env.RedisURL,
	}
	a, err := app.New(context.Background(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, a.Run)
	servicetest.WaitReady(t, a.Addr())
}

func TestREADMEConfig(t *testing.T) {
	servicetest.CheckREADMEConfig(t, "lookup", &app.Config{})
}
