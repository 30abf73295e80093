// Command lookup is kvmesh's lookup service. Configuration comes from
// the environment; see docs/configuration.md.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

func main() {
	var cfg app.Config
	os.Exit(service.Main("lookup", &cfg, func(ctx context.Context, log *slog.Logger) error {
		a, err := app.New(ctx, cfg, log)
		if err != nil {
			return err
		}
		return a.Run(ctx)
	}, service.WithGCPercent(service.ControlPlaneGCPercent)))
}
