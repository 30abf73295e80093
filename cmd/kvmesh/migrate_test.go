package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// upMigrations returns the names of the embedded up-migrations.
func upMigrations(t *testing.T) []string {
	t.Helper()
	names, err := fs.Glob(migrations.FS, "*.up.sql")
	if err != nil || len(names) == 0 {
		t.Fatalf("embedded migrations: %v %v", names, err)
	}
	return names
}

func TestMigrateAppliesOnceThenNothing(t *testing.T) {
	quiet(t)
	u := dbtest.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	want := upMigrations(t)

	var first bytes.Buffer
	if err := migrateDatabase(ctx, []string{"-database-url", u}, &first); err != nil {
		t.Fatalf("first run: %v", err)
	}
	for _, name := range want {
		if !strings.Contains(first.String(), "applied "+name+"\n") {
			t.Errorf("first run did not report %s:\n%s", name, first.String())
		}
	}
	if !strings.Contains(first.String(), fmt.Sprintf("%d migrations applied", len(want))) {
		t.Errorf("first run summary: %q, want %d applied", first.String(), len(want))
	}

	var second bytes.Buffer
	if err := migrateDatabase(ctx, []string{"-database-url", u}, &second); err != nil {
		t.Fatalf("second run: %v", err)
	}
	if strings.Contains(second.String(), "applied 0") || !strings.Contains(second.String(), "0 migrations applied") {
		t.Errorf("second run: %q, want nothing applied", second.String())
	}

	pool, err := database.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := database.CheckMigrated(ctx, pool, migrations.FS); err != nil {
		t.Fatalf("after migrate: %v", err)
	}
}

func TestMigrateReadsDatabaseURLFromEnv(t *testing.T) {
	quiet(t)
	u := dbtest.NewDatabase(t)
	t.Setenv("KVMESH_DATABASE_URL", u)
	var out bytes.Buffer
	if err := migrateDatabase(context.Background(), nil, &out); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("%d migrations applied", len(upMigrations(t))); !strings.Contains(out.String(), want) {
		t.Fatalf("output %q, want %q", out.String(), want)
	}
}

func TestMigrateIsRegistered(t *testing.T) {
	if _, ok := commands["migrate"]; !ok {
		t.Fatal("no migrate command")
	}
}

func TestMigrateFailures(t *testing.T) {
	for _, tc := range []struct {
		name     string
		env      string
		args     []string
		code     int
		contains string
	}{
		{name: "no database", code: 2, contains: "KVMESH_DATABASE_URL"},
		{name: "extra argument", env: "postgres://x@127.0.0.1/db", args: []string{"now"}, code: 2, contains: "unexpected arguments"},
		{name: "bad timeout", env: "postgres://x@127.0.0.1/db", args: []string{"-timeout", "0s"}, code: 2, contains: "timeout"},
		{name: "nothing listening", args: []string{"-database-url", "postgres://kvmesh:s3cret@127.0.0.1:1/kvmesh?sslmode=disable"},
			code: 1, contains: "database"},
		{name: "unparsable url", args: []string{"-database-url", "postgres://kvmesh:s3cret@[::1/kvmesh"}, code: 1, contains: "parse url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var errOut bytes.Buffer
			old := stderr
			stderr = &errOut
			t.Cleanup(func() { stderr = old })
			t.Setenv("KVMESH_DATABASE_URL", tc.env)

			err := dispatch(context.Background(), append([]string{"migrate"}, tc.args...))
			if err == nil {
				t.Fatal("migrate succeeded")
			}
			if code := exitCode(err); code != tc.code {
				t.Errorf("exit code %d, want %d (%v)", code, tc.code, err)
			}
			msg := errOut.String()
			if !strings.Contains(msg, tc.contains) {
				t.Errorf("message %q does not mention %q", msg, tc.contains)
			}
			if strings.Contains(msg, "s3cret") {
				t.Errorf("message leaks the password: %q", msg)
			}
			if tc.code == 2 && !errors.Is(err, errUsage) {
				t.Errorf("%v is not a usage error", err)
			}
		})
	}
}

func TestMigrateForceRecordsVersion(t *testing.T) {
	quiet(t)
	u := dbtest.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := migrateDatabase(ctx, []string{"-database-url", u, "-force", "1"}, &out); err != nil {
		t.Fatalf("migrate -force 1: %v", err)
	}
	if !strings.Contains(out.String(), "forced to 1") {
		t.Errorf("output %q, want it to report version 1", out.String())
	}
	pool, err := database.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	err = database.CheckMigrated(ctx, pool, migrations.FS)
	if want := upMigrations(t)[1]; !errors.Is(err, database.ErrNotMigrated) || !strings.Contains(err.Error(), want) {
		t.Errorf("after -force 1: CheckMigrated = %v, want ErrNotMigrated naming %s", err, want)
	}
	if err := migrateDatabase(ctx, []string{"-database-url", u, "-force", "999"}, &out); !errors.Is(err, database.ErrUnknownMigration) {
		t.Errorf("migrate -force 999 = %v, want ErrUnknownMigration", err)
	}
}
