package database

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/golang-migrate/migrate/v4"
	pgxmigrate "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// MigrationsTable is the table golang-migrate records the schema version in
// (one row: version, dirty). It is not schema_migrations, the table of the
// runner kvmesh used before, which Migrate adopts once (see Migrate).
const MigrationsTable = "schema_version"

// legacyMigrationsTable is the old runner's table: one row per applied
// version (version, name, applied_at).
const legacyMigrationsTable = "schema_migrations"

// migrationLockKey is the pg_advisory_lock key that serialises kvmesh's
// migration runners across processes ("kvmesh.mig" in ASCII). golang-migrate
// takes its own advisory lock too, but gives up after 15s; this one waits as
// long as ctx allows and makes reading the version before and after one
// atomic step, so each runner reports exactly what it applied.
const migrationLockKey int64 = 0x6b766d6573682e6d

// unlockTimeout bounds releasing the advisory lock once migrations are done.
const unlockTimeout = 5 * time.Second

// migrationName is kvmesh's naming rule, stricter than golang-migrate's
// (which silently skips names it cannot parse).
var migrationName = regexp.MustCompile(`^(\d{4,})_([a-z0-9][a-z0-9_]*)\.(up|down)\.sql$`)

// migration is one numbered schema change with its up and down file names.
type migration struct {
	version  int64
	name     string
	up, down string
}

// Migrate applies the up-migrations in fsys that the database has not seen,
// in version order, with golang-migrate, and returns the names of the files
// it applied.
//
// fsys holds NNNN_name.up.sql and NNNN_name.down.sql files at its root,
// numbered from 1 without gaps; other *.sql names are an error naming the
// file, and non-.sql files are ignored. Runners in any number of processes
// are serialised by a Postgres advisory lock. Each file runs as one
// statement batch, which Postgres executes as one implicit transaction, so
// a failed file changes no schema; golang-migrate then leaves its version
// marked dirty and later runs fail with ErrDirtyMigration until an operator
// runs ForceVersion. A database whose version is newer than fsys knows is
// left alone.
//
// A database last migrated by kvmesh's earlier runner (schema_migrations
// with versions 1..n, no MigrationsTable) is adopted at version n the first
// time; schema_migrations is left in place for binaries that still read it.
func Migrate(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS) ([]string, error) {
	set, err := loadMigrations(fsys)
	if err != nil {
		return nil, err
	}
	var applied []string
	err = withMigrator(ctx, pool, fsys, func(m *migrate.Migrate) error {
		from, err := currentVersion(m, set)
		if err != nil {
			return err
		}
		// One step at a time: each runner reports exactly what it ran, and
		// golang-migrate prefetches no file that a failure would strand.
		for _, mg := range set[min(from, int64(len(set))):] {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("database: migrate: %w", err)
			}
			if err := m.Steps(1); err != nil {
				return fmt.Errorf("database: run migration %q: %w", mg.up, err)
			}
			applied = append(applied, mg.up)
		}
		return nil
	})
	return applied, err
}

// MigrateDown reverts the steps most recently applied migrations, newest
// first, and returns the names of the down files it ran. It stops early when
// fewer migrations are applied.
func MigrateDown(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS, steps int) ([]string, error) {
	if steps < 1 {
		return nil, fmt.Errorf("database: migrate down %d: %w", steps, ErrInvalidSteps)
	}
	set, err := loadMigrations(fsys)
	if err != nil {
		return nil, err
	}
	var reverted []string
	err = withMigrator(ctx, pool, fsys, func(m *migrate.Migrate) error {
		from, err := currentVersion(m, set)
		if err != nil {
			return err
		}
		if from > int64(len(set)) {
			return fmt.Errorf("database: revert version %d: %w", from, ErrUnknownMigration)
		}
		for v := from; v > max(from-int64(steps), 0); v-- {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("database: migrate down: %w", err)
			}
			if err := m.Steps(-1); err != nil {
				return fmt.Errorf("database: run migration %q: %w", set[v-1].down, err)
			}
			reverted = append(reverted, set[v-1].down)
		}
		return nil
	})
	return reverted, err
}

// ForceVersion records version as the database's clean schema version
// without running any migration: the repair after a failed migration left
// the version dirty and the operator has brought the schema to version by
// hand (0 means no migration applied).
func ForceVersion(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS, version int) error {
	set, err := loadMigrations(fsys)
	if err != nil {
		return err
	}
	if version < 0 || version > len(set) {
		return fmt.Errorf("database: force version %d: want 0..%d: %w", version, len(set), ErrUnknownMigration)
	}
	if version == 0 {
		version = -1 // golang-migrate's NilVersion
	}
	return withMigrator(ctx, pool, fsys, func(m *migrate.Migrate) error {
		if err := m.Force(version); err != nil {
			return fmt.Errorf("database: force version %d: %w", version, err)
		}
		return nil
	})
}

// CheckMigrated reports ErrNotMigrated, naming the first missing version,
// unless every migration in fsys is applied. It changes nothing: services
// that do not own migrations use it as a readiness check.
func CheckMigrated(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS) error {
	set, err := loadMigrations(fsys)
	if err != nil {
		return err
	}
	var version int64
	var dirty bool
	if exists, err := tableExists(ctx, pool, MigrationsTable); err != nil || !exists {
		if err == nil {
			version, err = legacyVersion(ctx, pool)
		}
		if err != nil {
			return fmt.Errorf("%w: %w", ErrNotMigrated, err)
		}
	} else if err := pool.QueryRow(ctx, "SELECT version, dirty FROM "+MigrationsTable+" LIMIT 1").
		Scan(&version, &dirty); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: read %s: %w", ErrNotMigrated, MigrationsTable, err)
	}
	switch {
	case dirty:
		return fmt.Errorf("%w: version %d is dirty: %w", ErrNotMigrated, version, ErrDirtyMigration)
	case version < int64(len(set)):
		return fmt.Errorf("%w: %s not applied", ErrNotMigrated, set[max(version, 0)].up)
	}
	return nil
}

// withMigrator runs fn with a golang-migrate instance over pool and fsys,
// holding kvmesh's migration lock, after adopting a database migrated by the
// earlier runner.
func withMigrator(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS, fn func(*migrate.Migrate) error) error {
	return withMigrationLock(ctx, pool, func(conn *pgx.Conn) error {
		adopted, err := tableExists(ctx, conn, MigrationsTable)
		if err != nil {
			return err
		}
		var legacy int64
		if !adopted {
			if legacy, err = legacyVersion(ctx, conn); err != nil {
				return err
			}
		}
		src, err := iofs.New(fsys, ".")
		if err != nil {
			return fmt.Errorf("database: read migrations: %w", err)
		}
		drv, err := pgxmigrate.WithInstance(stdlib.OpenDBFromPool(pool), &pgxmigrate.Config{MigrationsTable: MigrationsTable})
		if err != nil {
			_ = src.Close()
			return fmt.Errorf("database: open migrator: %w", err)
		}
		m, err := migrate.NewWithInstance("iofs", src, "pgx5", drv)
		if err != nil {
			_, _ = src.Close(), drv.Close()
			return fmt.Errorf("database: open migrator: %w", err)
		}
		defer m.Close()
		if legacy > 0 {
			if err := m.Force(int(legacy)); err != nil {
				return fmt.Errorf("database: adopt %s at version %d: %w", legacyMigrationsTable, legacy, err)
			}
		}
		return fn(m)
	})
}

// currentVersion returns the clean schema version (0 when none), or
// ErrDirtyMigration naming the file that failed.
func currentVersion(m *migrate.Migrate, set []migration) (int64, error) {
	v, dirty, err := rawVersion(m)
	if err != nil {
		return 0, err
	}
	if dirty {
		file := fmt.Sprintf("version %d", v)
		if v >= 1 && v <= int64(len(set)) {
			file = set[v-1].up
		}
		return 0, fmt.Errorf("database: %s failed and left %s dirty at version %d; repair the schema by hand, then run kvmesh migrate -force VERSION: %w",
			file, MigrationsTable, v, ErrDirtyMigration)
	}
	return v, nil
}

// rawVersion returns golang-migrate's version (0 when none) and dirty flag.
func rawVersion(m *migrate.Migrate) (int64, bool, error) {
	v, dirty, err := m.Version()
	switch {
	case errors.Is(err, migrate.ErrNilVersion):
		return 0, false, nil
	case err != nil:
		return 0, false, fmt.Errorf("database: read %s: %w", MigrationsTable, err)
	}
	return int64(v), dirty, nil
}

// querier is what the version readers need of a connection or a pool.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// tableExists reports whether name resolves to a table on q's search path.
func tableExists(ctx context.Context, q querier, name string) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", name).Scan(&ok); err != nil {
		return false, fmt.Errorf("database: look up %s: %w", name, err)
	}
	return ok, nil
}

// legacyVersion returns the version the earlier runner recorded in
// schema_migrations (0 when that table is absent). That runner applied
// versions 1..n without gaps; anything else is ErrMigrationSequence.
func legacyVersion(ctx context.Context, q querier) (int64, error) {
	exists, err := tableExists(ctx, q, legacyMigrationsTable)
	if err != nil || !exists {
		return 0, err
	}
	var n, top int64
	if err := q.QueryRow(ctx, "SELECT count(*), coalesce(max(version), 0) FROM "+legacyMigrationsTable).
		Scan(&n, &top); err != nil {
		return 0, fmt.Errorf("database: read %s: %w", legacyMigrationsTable, err)
	}
	if n != top {
		return 0, fmt.Errorf("database: %s holds %d versions up to %d, want 1..%d: %w",
			legacyMigrationsTable, n, top, top, ErrMigrationSequence)
	}
	return top, nil
}

// withMigrationLock runs fn on a dedicated connection holding the migration
// advisory lock. If the lock cannot be released the connection is closed,
// which releases it.
func withMigrationLock(ctx context.Context, pool *pgxpool.Pool, fn func(*pgx.Conn) error) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("database: acquire migration connection: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", migrationLockKey); err != nil {
		return fmt.Errorf("database: take migration lock: %w", err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), unlockTimeout)
		defer cancel()
		if _, err := conn.Exec(uctx, "SELECT pg_advisory_unlock($1)", migrationLockKey); err != nil {
			_ = conn.Conn().Close(uctx) // closing the session releases the lock
		}
	}()
	return fn(conn.Conn())
}

// loadMigrations checks the *.sql names at fsys's root against kvmesh's
// rule and returns the migrations in version order. golang-migrate would
// skip a misnamed file and accept gaps; here both are errors naming a file.
func loadMigrations(fsys fs.FS) ([]migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("database: read migrations: %w", err)
	}
	byVersion := map[int64]*migration{}
	for _, e := range entries {
		if e.IsDir() || path.Ext(e.Name()) != ".sql" {
			continue
		}
		if err := addMigrationFile(byVersion, e.Name()); err != nil {
			return nil, err
		}
	}
	set := make([]migration, 0, len(byVersion))
	for _, m := range byVersion {
		set = append(set, *m)
	}
	slices.SortFunc(set, func(a, b migration) int { return cmp.Compare(a.version, b.version) })
	for i, m := range set {
		file := cmp.Or(m.up, m.down)
		if want := int64(i + 1); m.version != want {
			return nil, fmt.Errorf("database: migration %q: expected version %d (versions start at 1 without gaps): %w",
				file, want, ErrMigrationSequence)
		}
		if m.up == "" || m.down == "" {
			return nil, fmt.Errorf("database: migration %q has no matching %s file: %w",
				file, map[bool]string{true: "up", false: "down"}[m.up == ""], ErrMigrationSequence)
		}
	}
	return set, nil
}

// addMigrationFile parses file's name and records it under its version.
func addMigrationFile(byVersion map[int64]*migration, file string) error {
	parts := migrationName.FindStringSubmatch(file)
	if parts == nil {
		return fmt.Errorf("database: migration %q: want NNNN_name.up.sql or NNNN_name.down.sql: %w",
			file, ErrBadMigrationName)
	}
	version, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil || version < 1 {
		return fmt.Errorf("database: migration %q: version must be a positive integer: %w",
			file, ErrBadMigrationName)
	}
	m := byVersion[version]
	if m == nil {
		m = &migration{version: version, name: parts[2]}
		byVersion[version] = m
	}
	if m.name != parts[2] {
		return fmt.Errorf("database: migration %q: version %d is also named %q: %w",
			file, version, m.name, ErrMigrationSequence)
	}
	slot := &m.up
	if parts[3] == "down" {
		slot = &m.down
	}
	if *slot != "" {
		return fmt.Errorf("database: migration %q duplicates %q: %w", file, *slot, ErrMigrationSequence)
	}
	*slot = file
	return nil
}
