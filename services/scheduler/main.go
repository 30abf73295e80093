// Command scheduler is kvmesh's scheduler service. Configuration comes from
// the environment; see docs/configuration.md.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

func main() {
	var cfg app.Config
	os.Exit(service.Main("scheduler", &cfg, func(ctx context.Context, log *slog.Logger) error {
		a, err := app.New(ctx, cfg, log)
		if err != nil {
			return err
		}
		return a.Run(ctx)
	}, service.WithGCPercent(service.ControlPlaneGCPercent)))
}
