// Package dbtest gives tests a fresh PostgreSQL database of their own on the
// server named by testenv.DatabaseURL, dropped when the test ends.
//
// Database names carry a random suffix, so tests in parallel packages
// (go test -p N) and parallel subtests never collide.
package dbtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// adminTimeout bounds each CREATE or DROP DATABASE.
const adminTimeout = 30 * time.Second

// NewDatabase creates an empty database and returns its URL; the database is
// dropped (WITH (FORCE), closing any connection left open) when t ends.
func NewDatabase(t testing.TB) string {
	t.Helper()
	admin := testenv.DatabaseURL(t)
	name := databaseName(t)
	u, err := withDatabase(admin, name)
	if err != nil {
		t.Fatalf("dbtest: %v", err)
	}
	if err := withAdmin(admin, name, createDatabase); err != nil {
		t.Fatalf("dbtest: create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := withAdmin(admin, name, dropDatabase); err != nil {
			t.Errorf("dbtest: drop database %s: %v", name, err)
		}
	})
	return u
}

// NewPool creates a database as NewDatabase does, applies every migration in
// migrations.FS and returns a pool on it, closed when t ends.
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	u := NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	pool, err := database.Connect(ctx, u, database.WithApplicationName("kvmesh-test"))
	if err != nil {
		t.Fatalf("dbtest: %v", err)
	}
	t.Cleanup(pool.Close)
	if _, err := database.Migrate(ctx, pool, migrations.FS); err != nil {
		t.Fatalf("dbtest: migrate: %v", err)
	}
	return pool
}

// createDatabase creates database name. When the server runs with fsync off
// (a disposable test cluster), copying the template's files (STRATEGY
// FILE_COPY) is several times faster than the default WAL_LOG strategy; with
// fsync on it is slower, so the default stays.
func createDatabase(ctx context.Context, conn *pgx.Conn, name string) error {
	var fsync string
	if err := conn.QueryRow(ctx, "SELECT current_setting('fsync')").Scan(&fsync); err != nil {
		return err
	}
	sql := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if fsync == "off" {
		sql += " STRATEGY FILE_COPY"
	}
	_, err := conn.Exec(ctx, sql)
	return err
}

// dropDatabase drops database name, closing any connection left open.
func dropDatabase(ctx context.Context, conn *pgx.Conn, name string) error {
	_, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	return err
}

// databaseName returns "t_<test name>_<random>", a valid, unique identifier
// of at most 63 bytes that names the test in pg_stat_activity.
func databaseName(t testing.TB) string {
	var b strings.Builder
	for _, r := range strings.ToLower(t.Name()) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
		if b.Len() == 36 {
			break
		}
	}
	return "t_" + b.String() + "_" + randomHex(8)
}

// randomHex returns 2n random hex digits.
func randomHex(n int) string {
	buf := make([]byte, n)
	_, _ = rand.Read(buf) // crypto/rand.Read never fails
	return hex.EncodeToString(buf)
}

// withAdmin runs fn for database name on a short-lived connection to the
// admin URL.
func withAdmin(adminURL, name string, fn func(context.Context, *pgx.Conn, string) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", database.MaskURL(adminURL), err)
	}
	defer func() { _ = conn.Close(ctx) }()
	return fn(ctx, conn, name)
}

// withDatabase returns adminURL pointing at database name instead.
func withDatabase(adminURL, name string) (string, error) {
	if !strings.Contains(adminURL, "://") {
		return adminURL + " dbname=" + name, nil // keyword/value: the last setting wins
	}
	u, err := url.Parse(adminURL)
	if err != nil {
		return "", fmt.Errorf("parse %s: invalid URL", database.MaskURL(adminURL))
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), nil
}
