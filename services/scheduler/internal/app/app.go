// Package app is the scheduler service: the engine's scheduler-side
// connector, keeping every request's tracker in PostgreSQL and emitting load
// and save tasks through the transactional outbox.
package app

import (
	"context"
	"log/slog"

	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// Config is the scheduler's configuration.
type Config struct {
	service.Common
	// HTTPAddr is the admin and health listen address.
	HTTPAddr string `env:"KVMESH_HTTP_ADDR" default:":8082" doc:"listen address of the service's HTTP API"`
	// DatabaseURL locates PostgreSQL.
	DatabaseURL string `env:"KVMESH_DATABASE_URL" secret:"true" required:"true" doc:"PostgreSQL URL (postgres://user:pass@host:port/db)"`
	// Migrate applies migrations at start.
	Migrate bool `env:"KVMESH_MIGRATE" default:"true" doc:"scheduler only: apply database migrations at start"`
}

// App is a wired scheduler, ready to Run.
type App struct {
	deps  *service.Deps
	model *kvcore.Model
	srv   *httpserver.Server
	relay *database.Relay
}

// New connects to PostgreSQL (applying migrations), Kafka and binds the HTTP
// address, in that order.
func New(ctx context.Context, cfg Config, log *slog.Logger) (_ *App, err error) {
	a := &App{deps: service.NewDeps(log)}
	defer func() {
		if err != nil {
			a.deps.Close()
		}
	}()
	if a.model, err = service.LoadModel(cfg.Model); err != nil {
		return nil, err
	}
	if err = a.deps.OpenDatabase(ctx, cfg.DatabaseURL, "kvmesh-scheduler", cfg.Migrate); err != nil {
		return nil, err
	}
	if err = a.deps.OpenBus(ctx, &cfg.Common); err != nil {
		return nil, err
	}
	a.relay = database.NewRelay(a.deps.Pool, a.deps.Producer, database.WithLogger(log))
	if a.srv, err = a.deps.HTTPServer(cfg.HTTPAddr, "scheduler", &cfg.Common); err != nil {
		return nil, err
	}
	return a, nil
}

// Addr is the bound HTTP address.
func (a *App) Addr() string { return a.srv.Addr() }

// Run serves until ctx is cancelled, then releases every connection.
func (a *App) Run(ctx context.Context) error {
	defer a.deps.Close()
	return service.Run(ctx, a.deps.Log,
		service.Task{Name: "http", Run: a.srv.Run},
		service.Task{Name: "outbox-relay", Run: a.relay.Run},
	)
}
