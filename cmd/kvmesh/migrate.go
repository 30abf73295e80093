package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/service"
)

func init() {
	register("migrate", "apply the pending PostgreSQL migrations (KVMESH_DATABASE_URL) and exit", runMigrate)
}

// runMigrate applies the pending migrations and reports them on stdout.
func runMigrate(ctx context.Context, args []string) error {
	return migrateDatabase(ctx, args, os.Stdout)
}

// migrateOptions is what the migrate command line says.
type migrateOptions struct {
	url     string
	timeout time.Duration
	force   int // -1: not forcing
}

// migrateDatabase connects to the database, applies every migration it has
// not seen under the runner's advisory lock, and writes one line per
// applied file and a summary to out. With -force it only records the given
// version as clean, the repair after a failed migration.
func migrateDatabase(ctx context.Context, args []string, out io.Writer) error {
	o, err := migrateFlags(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	pool, err := database.Connect(ctx, o.url, database.WithApplicationName("kvmesh-migrate"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if o.force >= 0 {
		if err := database.ForceVersion(ctx, pool, migrations.FS, o.force); err != nil {
			return err
		}
		fmt.Fprintf(out, "schema version forced to %d; database %s\n", o.force, database.MaskURL(o.url))
		return nil
	}
	applied, err := database.Migrate(ctx, pool, migrations.FS)
	if err != nil {
		return err
	}
	for _, name := range applied {
		fmt.Fprintf(out, "applied %s\n", name)
	}
	fmt.Fprintf(out, "%d migrations applied; database %s is up to date\n", len(applied), database.MaskURL(o.url))
	return nil
}

// migrateFlags reads the flags; the database URL defaults to
// KVMESH_DATABASE_URL.
func migrateFlags(args []string) (migrateOptions, error) {
	var o migrateOptions
	var db service.Database
	if err := config.Overlay(&db, os.LookupEnv); err != nil {
		return o, fmt.Errorf("%w: %w", errUsage, err)
	}
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.url, "database-url", db.DatabaseURL,
		"PostgreSQL URL, postgres://user:pass@host:port/db (env KVMESH_DATABASE_URL)")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute,
		"give up when connecting and migrating take longer (the advisory lock may be held by another runner)")
	fs.IntVar(&o.force, "force", -1,
		"record VERSION as the clean schema version and run nothing (repair after a failed migration left it dirty)")
	rest, err := parseFlags(fs, args)
	if err != nil {
		return o, err
	}
	switch {
	case len(rest) > 0:
		return o, fmt.Errorf("%w: unexpected arguments %q", errUsage, rest)
	case strings.TrimSpace(o.url) == "":
		return o, fmt.Errorf("%w: no database: set KVMESH_DATABASE_URL or -database-url", errUsage)
	case o.timeout <= 0:
		return o, fmt.Errorf("%w: -timeout %s is not positive", errUsage, o.timeout)
	}
	return o, nil
}
