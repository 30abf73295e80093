package database_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// emptyPool returns a pool on a fresh database with no migrations applied.
func emptyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := database.Connect(t.Context(), dbtest.NewDatabase(t))
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// file builds one fstest.MapFS entry.
func file(sql string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(sql)} }

// threeTables is a migration set whose up scripts fail if run twice.
func threeTables() fstest.MapFS {
	return fstest.MapFS{
		"0001_a.up.sql":   file("CREATE TABLE a (id int)"),
		"0001_a.down.sql": file("DROP TABLE a"),
		"0002_b.up.sql":   file("CREATE TABLE b (id int); INSERT INTO b VALUES (1)"),
		"0002_b.down.sql": file("DROP TABLE b"),
		"0003_c.up.sql":   file("CREATE TABLE c (id int)"),
		"0003_c.down.sql": file("DROP TABLE c"),
		"README.md":       file("not a migration; ignored"),
	}
}

// versions returns the applied versions 1..v, where v is the clean version
// golang-migrate recorded in database.MigrationsTable; a dirty version fails
// the test.
func versions(t *testing.T, pool *pgxpool.Pool) []int64 {
	t.Helper()
	var v int64
	var dirty bool
	err := pool.QueryRow(t.Context(), "SELECT version, dirty FROM "+database.MigrationsTable).Scan(&v, &dirty)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("read %s: %v", database.MigrationsTable, err)
	}
	if dirty {
		t.Fatalf("%s: version %d is dirty", database.MigrationsTable, v)
	}
	vs := []int64{}
	for i := int64(1); i <= v; i++ {
		vs = append(vs, i)
	}
	return vs
}

// tableExists reports whether a table of that name exists in the public schema.
func tableExists(t *testing.T, pool *pgxpool.Pool, name string) bool {
	t.Helper()
	var ok bool
	if err := pool.QueryRow(t.Context(), "SELECT to_regclass($1) IS NOT NULL", name).Scan(&ok); err != nil {
		t.Fatalf("to_regclass(%s): %v", name, err)
	}
	return ok
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	applied, err := database.Migrate(t.Context(), pool, threeTables())
	if err != nil {
		t.Fatalf("first Migrate: %v", err)
	}
	want := []string{"0001_a.up.sql", "0002_b.up.sql", "0003_c.up.sql"}
	if !slices.Equal(applied, want) {
		t.Errorf("first Migrate applied %v, want %v", applied, want)
	}
	applied, err = database.Migrate(t.Context(), pool, threeTables())
	if err != nil || len(applied) != 0 {
		t.Errorf("second Migrate applied %v, err %v; want nothing", applied, err)
	}
	if got := versions(t, pool); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Errorf("schema_migrations versions = %v, want [1 2 3]", got)
	}
}

func TestMigrateEmbeddedSchema(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	applied, err := database.Migrate(t.Context(), pool, migrations.FS)
	if err != nil || len(applied) == 0 || applied[0] != "0001_outbox.up.sql" {
		t.Fatalf("Migrate(migrations.FS) = %v, %v; want 0001_outbox.up.sql first", applied, err)
	}
	if !tableExists(t, pool, "outbox") {
		t.Error("outbox table missing after migrations")
	}
	reverted, err := database.MigrateDown(t.Context(), pool, migrations.FS, len(applied))
	if err != nil || len(reverted) != len(applied) {
		t.Fatalf("MigrateDown all = %v, %v", reverted, err)
	}
	if tableExists(t, pool, "outbox") || len(versions(t, pool)) != 0 {
		t.Error("schema left behind after reverting every migration")
	}
}

func TestMigrateDownThenUp(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	if _, err := database.Migrate(t.Context(), pool, threeTables()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	reverted, err := database.MigrateDown(t.Context(), pool, threeTables(), 2)
	if err != nil || !slices.Equal(reverted, []string{"0003_c.down.sql", "0002_b.down.sql"}) {
		t.Fatalf("MigrateDown(2) = %v, %v; want 0003 then 0002", reverted, err)
	}
	if tableExists(t, pool, "b") || tableExists(t, pool, "c") || !tableExists(t, pool, "a") {
		t.Error("after MigrateDown(2) want only table a")
	}
	if got := versions(t, pool); !slices.Equal(got, []int64{1}) {
		t.Errorf("versions after down = %v, want [1]", got)
	}
	applied, err := database.Migrate(t.Context(), pool, threeTables())
	if err != nil || !slices.Equal(applied, []string{"0002_b.up.sql", "0003_c.up.sql"}) {
		t.Errorf("Migrate after down = %v, %v; want 0002 and 0003", applied, err)
	}
	if _, err := database.MigrateDown(t.Context(), pool, threeTables(), 0); !errors.Is(err, database.ErrInvalidSteps) {
		t.Errorf("MigrateDown(0) error = %v, want ErrInvalidSteps", err)
	}
}

func TestMigrateDownUnknownVersion(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	if _, err := database.Migrate(t.Context(), pool, threeTables()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	older := threeTables()
	delete(older, "0003_c.up.sql")
	delete(older, "0003_c.down.sql")
	if applied, err := database.Migrate(t.Context(), pool, older); err != nil || len(applied) != 0 {
		t.Errorf("Migrate with an older set = %v, %v; want nothing applied", applied, err)
	}
	_, err := database.MigrateDown(t.Context(), pool, older, 1)
	if !errors.Is(err, database.ErrUnknownMigration) {
		t.Errorf("MigrateDown with version 3 unknown: error = %v, want ErrUnknownMigration", err)
	}
}

func TestMigrateConcurrentRunners(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	const runners = 4
	results := make([][]string, runners)
	errs := make([]error, runners)
	var wg sync.WaitGroup
	for i := range runners {
		wg.Go(func() {
			// A pool per runner stands in for separate processes.
			p, err := database.Connect(context.Background(), pool.Config().ConnString())
			if err != nil {
				errs[i] = err
				return
			}
			defer p.Close()
			results[i], errs[i] = database.Migrate(context.Background(), p, threeTables())
		})
	}
	wg.Wait()
	var all []string
	for i := range runners {
		if errs[i] != nil {
			t.Errorf("runner %d: %v", i, errs[i])
		}
		all = append(all, results[i]...)
	}
	slices.Sort(all)
	if want := []string{"0001_a.up.sql", "0002_b.up.sql", "0003_c.up.sql"}; !slices.Equal(all, want) {
		t.Errorf("runners applied %v in total, want each of %v exactly once", all, want)
	}
	var rows int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM b").Scan(&rows); err != nil || rows != 1 {
		t.Errorf("table b has %d rows (%v), want 1", rows, err)
	}
}

func TestMigrateFailureRollsBack(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	fsys := threeTables()
	fsys["0002_b.up.sql"] = file("CREATE TABLE b (id int); SELECT no_such_function()")
	applied, err := database.Migrate(t.Context(), pool, fsys)
	if err == nil || !strings.Contains(err.Error(), "0002_b.up.sql") {
		t.Fatalf("Migrate error = %v, want one naming 0002_b.up.sql", err)
	}
	if !slices.Equal(applied, []string{"0001_a.up.sql"}) {
		t.Errorf("applied = %v, want only 0001_a.up.sql", applied)
	}
	if tableExists(t, pool, "b") {
		t.Error("failed migration 0002 left table b behind")
	}

	// golang-migrate marks version 2 dirty: runs refuse until it is forced.
	applied, err = database.Migrate(t.Context(), pool, threeTables())
	if !errors.Is(err, database.ErrDirtyMigration) || !strings.Contains(err.Error(), "0002_b.up.sql") || len(applied) != 0 {
		t.Fatalf("Migrate over a dirty version = %v, %v; want ErrDirtyMigration naming 0002_b.up.sql", applied, err)
	}
	if err := database.CheckMigrated(t.Context(), pool, threeTables()); !errors.Is(err, database.ErrNotMigrated) ||
		!errors.Is(err, database.ErrDirtyMigration) {
		t.Errorf("CheckMigrated over a dirty version = %v, want ErrNotMigrated and ErrDirtyMigration", err)
	}
	if err := database.ForceVersion(t.Context(), pool, threeTables(), 4); !errors.Is(err, database.ErrUnknownMigration) {
		t.Errorf("ForceVersion(4) of 3 = %v, want ErrUnknownMigration", err)
	}
	if err := database.ForceVersion(t.Context(), pool, threeTables(), 1); err != nil {
		t.Fatalf("ForceVersion(1): %v", err)
	}
	applied, err = database.Migrate(t.Context(), pool, threeTables())
	if err != nil || !slices.Equal(applied, []string{"0002_b.up.sql", "0003_c.up.sql"}) {
		t.Errorf("Migrate after ForceVersion(1) = %v, %v; want 0002 and 0003", applied, err)
	}
	if !slices.Equal(versions(t, pool), []int64{1, 2, 3}) {
		t.Errorf("versions = %v, want [1 2 3]", versions(t, pool))
	}
}

// legacyRunner reproduces what kvmesh's earlier runner left behind: the
// schema of the first n migrations of threeTables and their rows in its
// schema_migrations table.
func legacyRunner(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := t.Context()
	stmts := []string{`CREATE TABLE schema_migrations (
		version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`}
	fsys := threeTables()
	for i, name := range []string{"a", "b", "c"}[:n] {
		up, err := fsys.ReadFile(fmt.Sprintf("%04d_%s.up.sql", i+1, name))
		if err != nil {
			t.Fatal(err)
		}
		stmts = append(stmts, string(up),
			fmt.Sprintf("INSERT INTO schema_migrations (version, name) VALUES (%d, '%s')", i+1, name))
	}
	for _, sql := range stmts {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("legacy runner: %s: %v", sql, err)
		}
	}
}

func TestMigrateAdoptsLegacyRunner(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	legacyRunner(t, pool, 2)
	if err := database.CheckMigrated(t.Context(), pool, threeTables()); !errors.Is(err, database.ErrNotMigrated) ||
		!strings.Contains(err.Error(), "0003_c.up.sql") {
		t.Errorf("CheckMigrated on a legacy database at 2 = %v, want ErrNotMigrated naming 0003_c.up.sql", err)
	}
	older := threeTables()
	delete(older, "0003_c.up.sql")
	delete(older, "0003_c.down.sql")
	if err := database.CheckMigrated(t.Context(), pool, older); err != nil {
		t.Errorf("CheckMigrated on a legacy database at 2 of 2: %v", err)
	}

	applied, err := database.Migrate(t.Context(), pool, threeTables())
	if err != nil || !slices.Equal(applied, []string{"0003_c.up.sql"}) {
		t.Fatalf("Migrate over a legacy database = %v, %v; want only 0003_c.up.sql", applied, err)
	}
	if got := versions(t, pool); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Errorf("versions after adoption = %v, want [1 2 3]", got)
	}
	var legacyRows int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM schema_migrations").Scan(&legacyRows); err != nil || legacyRows != 2 {
		t.Errorf("schema_migrations has %d rows (%v), want the 2 the old runner wrote, untouched", legacyRows, err)
	}

	// Adoption happens once: reverting everything and migrating again runs
	// every file rather than trusting schema_migrations a second time.
	if _, err := database.MigrateDown(t.Context(), pool, threeTables(), 3); err != nil {
		t.Fatalf("MigrateDown(3): %v", err)
	}
	applied, err = database.Migrate(t.Context(), pool, threeTables())
	if err != nil || len(applied) != 3 || !tableExists(t, pool, "a") {
		t.Errorf("Migrate after reverting an adopted database = %v, %v; want all three applied", applied, err)
	}
}

func TestMigrateRejectsGappedLegacyTable(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	legacyRunner(t, pool, 1)
	if _, err := pool.Exec(t.Context(), "INSERT INTO schema_migrations (version, name) VALUES (3, 'c')"); err != nil {
		t.Fatal(err)
	}
	if _, err := database.Migrate(t.Context(), pool, threeTables()); !errors.Is(err, database.ErrMigrationSequence) {
		t.Errorf("Migrate over schema_migrations {1, 3} = %v, want ErrMigrationSequence", err)
	}
}

func TestMigrateRejectsBadSets(t *testing.T) {
	t.Parallel()
	pool := emptyPool(t)
	tests := []struct {
		name    string
		edit    func(fstest.MapFS)
		wantErr error
		naming  string
	}{
		{"no direction", func(f fstest.MapFS) { f["0004_d.sql"] = file("") },
			database.ErrBadMigrationName, "0004_d.sql"},
		{"short version", func(f fstest.MapFS) { f["4_d.up.sql"] = file("") },
			database.ErrBadMigrationName, "4_d.up.sql"},
		{"dash separator", func(f fstest.MapFS) { f["0004-d.up.sql"] = file("") },
			database.ErrBadMigrationName, "0004-d.up.sql"},
		{"upper case name", func(f fstest.MapFS) { f["0004_D.up.sql"] = file("") },
			database.ErrBadMigrationName, "0004_D.up.sql"},
		{"version zero", func(f fstest.MapFS) { f["0000_z.up.sql"] = file("") },
			database.ErrBadMigrationName, "0000_z.up.sql"},
		{"gap", func(f fstest.MapFS) {
			f["0005_e.up.sql"], f["0005_e.down.sql"] = file(""), file("")
		}, database.ErrMigrationSequence, "0005_e.up.sql"},
		{"duplicate version", func(f fstest.MapFS) { f["0002_bb.up.sql"] = file("") },
			database.ErrMigrationSequence, "0002_b"},
		{"missing down", func(f fstest.MapFS) { delete(f, "0003_c.down.sql") },
			database.ErrMigrationSequence, "0003_c.up.sql"},
		{"missing up", func(f fstest.MapFS) { delete(f, "0003_c.up.sql") },
			database.ErrMigrationSequence, "0003_c.down.sql"},
		{"missing first", func(f fstest.MapFS) {
			delete(f, "0001_a.up.sql")
			delete(f, "0001_a.down.sql")
		}, database.ErrMigrationSequence, "0002_b.up.sql"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fsys := threeTables()
			tt.edit(fsys)
			applied, err := database.Migrate(t.Context(), pool, fsys)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Migrate error = %v, want %v", err, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.naming) {
				t.Errorf("error %q does not name %q", err, tt.naming)
			}
			if len(applied) != 0 {
				t.Errorf("applied %v from an invalid set", applied)
			}
		})
	}
	if tableExists(t, pool, database.MigrationsTable) {
		t.Error("invalid sets touched the database")
	}
}

func TestCheckMigrated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := database.Connect(ctx, dbtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := database.CheckMigrated(ctx, pool, migrations.FS); !errors.Is(err, database.ErrNotMigrated) {
		t.Fatalf("fresh database: got %v, want ErrNotMigrated", err)
	}
	if _, err := database.Migrate(ctx, pool, migrations.FS); err != nil {
		t.Fatal(err)
	}
	if err := database.CheckMigrated(ctx, pool, migrations.FS); err != nil {
		t.Fatalf("after Migrate: %v", err)
	}
}
