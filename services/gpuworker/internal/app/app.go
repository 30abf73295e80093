// Package app is the gpuworker service: one engine rank's paged KV pool, moving block bytes between it and the store pool.
package app

import (
	"context"
	"log/slog"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// Config is the gpuworker's configuration.
type Config struct {
	service.Common
	// HTTPAddr is the API and health listen address.
	HTTPAddr string `env:"KVMESH_HTTP_ADDR" default:":8084" doc:"listen address of the service's HTTP API"`
	// DatabaseURL locates PostgreSQL.
	DatabaseURL string `env:"KVMESH_DATABASE_URL" secret:"true" required:"true" doc:"PostgreSQL URL (postgres://user:pass@host:port/db)"`
	// RedisURL locates the store pool.
	RedisURL string `env:"KVMESH_REDIS_URL" secret:"true" required:"true" doc:"store pool URL (redis://host:port/db)"`
}

// App is a wired gpuworker, ready to Run.
type App struct {
	deps  *service.Deps
	model *kvcore.Model
	srv   *httpserver.Server
}

// New opens the service's connections and binds the HTTP address, in a
// fixed order.
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
	if err = a.deps.OpenDatabase(ctx, cfg.DatabaseURL, "kvmesh-gpuworker", false); err != nil {
		return nil, err
	}
	if err = a.deps.OpenStore(ctx, cfg.RedisURL); err != nil {
		return nil, err
	}
	if err = a.deps.OpenBus(ctx, &cfg.Common); err != nil {
		return nil, err
	}
	if a.srv, err = a.deps.HTTPServer(cfg.HTTPAddr, "gpuworker", &cfg.Common); err != nil {
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
	)
}
