// Package servicetest runs kvmesh services inside tests against real parts:
// an embedded Kafka-protocol broker over TCP, a fresh PostgreSQL database and
// the Redis server that `make test` starts.
package servicetest

import (
	"context"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// StopWithin is how long a service may take to stop once its context ends.
const StopWithin = 5 * time.Second

// Env is the infrastructure one test's services share.
type Env struct {
	// Brokers are the embedded broker's addresses.
	Brokers []string
	// DatabaseURL is a fresh, migrated database of this test's own.
	DatabaseURL string
	// RedisURL is the shared Redis server.
	RedisURL string
}

// NewEnv starts a broker on a free port and creates a migrated database;
// both go away when the test ends.
func NewEnv(t testing.TB) *Env {
	t.Helper()
	redisURL := testenv.RedisURL(t)
	dbURL := dbtest.NewDatabase(t)
	ctx := context.Background()
	pool, err := database.Connect(ctx, dbURL)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer pool.Close()
	if _, err := database.Migrate(ctx, pool, migrations.FS); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", GroupMinSessionTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatalf("broker: %v", err)
	}
	t.Cleanup(b.Close)
	return &Env{Brokers: b.Addrs(), DatabaseURL: dbURL, RedisURL: redisURL}
}

// AuthKey is the auth key of services a test runs with authentication
// (Env.SecuredCommon).
const AuthKey = "kvmesh-servicetest-auth-key-0123456789"

// Common returns shared service settings pointing at the env, without
// authentication (KVMESH_AUTH=off): tests of other things call the
// routes without credentials. Admin mutations still need "test-token".
func (e *Env) Common() service.Common {
	return service.Common{
		LogLevel:        "debug",
		KafkaBrokers:    service.KafkaBrokers{Brokers: e.Brokers},
		Partitions:      2,
		Admin:           service.Admin{AdminToken: "test-token"},
		ShutdownTimeout: 2 * time.Second,
		SessionTimeout:  2 * time.Second,
		ModelSpec:       service.ModelSpec{Model: service.DefaultModel},
		Auth:            auth.Config{Mode: auth.ModeOff},
	}
}

// SecuredCommon is Common with authentication required, keyed AuthKey,
// "test-token" being the operator token.
func (e *Env) SecuredCommon() service.Common {
	c := e.Common()
	c.Auth = auth.Config{Mode: auth.ModeRequired, Key: AuthKey}
	return c
}

// Start runs run in the background. When the test ends the context is
// cancelled and the test fails unless run returns nil within StopWithin.
func Start(t testing.TB, run func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("service stopped with error: %v", err)
			}
		case <-time.After(StopWithin):
			t.Errorf("service did not stop within %s", StopWithin)
		}
	})
}

// WaitReady polls GET http://addr/readyz until it answers 200, failing the
// test after 30 s.
func WaitReady(t testing.TB, addr string) {
	t.Helper()
	if err := testenv.WaitReady("http://"+addr+"/readyz", 30*time.Second, nil); err != nil {
		t.Fatalf("%s: %v", addr, err)
	}
}

// App is a service's application as its New returns it.
type App interface {
	Run(ctx context.Context) error
	Addr() string
}

// StartReady fails the test when New failed (err), else runs a with Start
// and waits until its /readyz answers 200; it returns a.
func StartReady[A App](t testing.TB, a A, err error) A {
	t.Helper()
	if err != nil {
		t.Fatalf("new service: %v", err)
	}
	Start(t, a.Run)
	WaitReady(t, a.Addr())
	return a
}
