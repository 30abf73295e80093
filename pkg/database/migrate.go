package database

import (
	"cmp"
	"context"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// migrationLockKey is the pg_advisory_lock key that serialises migration
// runners across processes ("kvmesh.mig" in ASCII).
const migrationLockKey int64 = 0x6b766d6573682e6d

// unlockTimeout bounds releasing the advisory lock once migrations are done.
const unlockTimeout = 5 * time.Second

const createSchemaMigrations = `CREATE TABLE IF NOT EXISTS schema_migrations (
	version    bigint      PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now()
)`

var migrationName = regexp.MustCompile(`^(\d{4,})_([a-z0-9][a-z0-9_]*)\.(up|down)\.sql$`)

// migration is one numbered schema change with its up and down scripts.
type migration struct {
	version  int64
	name     string
	up, down string // file names
}

// Migrate applies the up-migrations in fsys that the database has not seen,
// in version order, and returns the names of the files it applied.
//
// fsys holds NNNN_name.up.sql and NNNN_name.down.sql files at its root,
// numbered from 1 without gaps; other *.sql names are an error naming the
// file, and non-.sql files are ignored. Runners in any number of processes
// are serialised by a Postgres advisory lock held on one connection; each
// migration runs in its own transaction together with its row in
// schema_migrations, so a failed migration leaves no trace and a second run
// applies nothing. Applied versions unknown to fsys (a newer schema) are left
// alone.
func Migrate(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS) ([]string, error) {
	set, err := loadMigrations(fsys)
	if err != nil {
		return nil, err
	}
	var applied []string
	err = withMigrationLock(ctx, pool, func(conn *pgx.Conn) error {
		done, err := appliedVersions(ctx, conn)
		if err != nil {
			return err
		}
		for _, m := range set {
			if done[m.version] {
				continue
			}
			if err := runMigration(ctx, conn, fsys, m, m.up); err != nil {
				return err
			}
			applied = append(applied, m.up)
		}
		return nil
	})
	return applied, err
}

// MigrateDown reverts the steps most recently applied migrations, newest
// first, each in its own transaction, and returns the names of the down files
// it ran. It stops early when fewer migrations are applied.
func MigrateDown(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS, steps int) ([]string, error) {
	if steps < 1 {
		return nil, fmt.Errorf("database: migrate down %d: %w", steps, ErrInvalidSteps)
	}
	set, err := loadMigrations(fsys)
	if err != nil {
		return nil, err
	}
	byVersion := make(map[int64]migration, len(set))
	for _, m := range set {
		byVersion[m.version] = m
	}
	var reverted []string
	err = withMigrationLock(ctx, pool, func(conn *pgx.Conn) error {
		done, err := appliedVersions(ctx, conn)
		if err != nil {
			return err
		}
		for _, v := range newestFirst(done, steps) {
			m, ok := byVersion[v]
			if !ok {
				return fmt.Errorf("database: revert version %d: %w", v, ErrUnknownMigration)
			}
			if err := runMigration(ctx, conn, fsys, m, m.down); err != nil {
				return err
			}
			reverted = append(reverted, m.down)
		}
		return nil
	})
	return reverted, err
}

// newestFirst returns at most n of the versions in done, highest first.
func newestFirst(done map[int64]bool, n int) []int64 {
	versions := make([]int64, 0, len(done))
	for v := range done {
		versions = append(versions, v)
	}
	slices.Sort(versions)
	slices.Reverse(versions)
	return versions[:min(n, len(versions))]
}

// loadMigrations reads and validates the migration files at fsys's root.
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
	return sequence(byVersion)
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

// sequence orders migrations and checks they run 1, 2, 3… with both scripts.
func sequence(byVersion map[int64]*migration) ([]migration, error) {
	set := make([]migration, 0, len(byVersion))
	for _, m := range byVersion {
		set = append(set, *m)
	}
	slices.SortFunc(set, func(a, b migration) int { return cmp.Compare(a.version, b.version) })
	for i, m := range set {
		if want := int64(i + 1); m.version != want {
			return nil, fmt.Errorf("database: migration %q: expected version %d (versions start at 1 without gaps): %w",
				m.fileName(), want, ErrMigrationSequence)
		}
		if m.up == "" || m.down == "" {
			return nil, fmt.Errorf("database: migration %q has no matching %s file: %w",
				m.fileName(), m.missingDirection(), ErrMigrationSequence)
		}
	}
	return set, nil
}

// fileName names one of m's files for error messages.
func (m migration) fileName() string {
	if m.up != "" {
		return m.up
	}
	return m.down
}

// missingDirection reports which of m's scripts is absent.
func (m migration) missingDirection() string {
	if m.up == "" {
		return "up"
	}
	return "down"
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

// appliedVersions creates schema_migrations if needed and returns the
// versions recorded there.
func appliedVersions(ctx context.Context, conn *pgx.Conn) (map[int64]bool, error) {
	if _, err := conn.Exec(ctx, createSchemaMigrations); err != nil {
		return nil, fmt.Errorf("database: create schema_migrations: %w", err)
	}
	return readVersions(ctx, conn)
}

// querier is what readVersions needs of a connection or a pool.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// readVersions returns the versions recorded in schema_migrations.
func readVersions(ctx context.Context, q querier) (map[int64]bool, error) {
	rows, _ := q.Query(ctx, "SELECT version FROM schema_migrations")
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("database: read schema_migrations: %w", err)
	}
	done := make(map[int64]bool, len(versions))
	for _, v := range versions {
		done[v] = true
	}
	return done, nil
}

// runMigration executes file (m's up or down script) and records the new
// state of m.version in schema_migrations, in one transaction.
func runMigration(ctx context.Context, conn *pgx.Conn, fsys fs.FS, m migration, file string) error {
	script, err := fs.ReadFile(fsys, file)
	if err != nil {
		return fmt.Errorf("database: read migration %q: %w", file, err)
	}
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if strings.TrimSpace(string(script)) != "" {
			if _, err := tx.Exec(ctx, string(script)); err != nil {
				return err
			}
		}
		return recordMigration(ctx, tx, m, file == m.up)
	})
	if err != nil {
		return fmt.Errorf("database: run migration %q: %w", file, err)
	}
	return nil
}

// recordMigration inserts (up) or deletes (down) m's schema_migrations row.
func recordMigration(ctx context.Context, tx pgx.Tx, m migration, up bool) error {
	var err error
	if up {
		_, err = tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.version, m.name)
	} else {
		_, err = tx.Exec(ctx, "DELETE FROM schema_migrations WHERE version = $1", m.version)
	}
	if err != nil {
		return fmt.Errorf("record version %d: %w", m.version, err)
	}
	return nil
}

// CheckMigrated reports ErrNotMigrated, naming the first missing version,
// unless every migration in fsys is applied. It changes nothing: services
// that do not own migrations use it as a readiness check.
func CheckMigrated(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS) error {
	migs, err := loadMigrations(fsys)
	if err != nil {
		return err
	}
	done, err := readVersions(ctx, pool)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	}
	for _, m := range migs {
		if !done[m.version] {
			return fmt.Errorf("%w: %s not applied", ErrNotMigrated, m.fileName())
		}
	}
	return nil
}
