// Package testenv gives tests the real parts they run against: the addresses
// of the servers that `make test` starts (PostgreSQL and Redis, via
// scripts/devstack.sh), private redis-servers a test may stop (StartRedis),
// private S3 servers whose objects are plain files (StartS3: versitygw,
// which scripts/s3server.sh builds), a TCP proxy that makes a server slow or
// unreachable (StartDelayProxy), the service binaries for tests that run and
// kill them (BuildBinary, ServiceBinaries), a harness that runs those
// binaries as processes (Procs), per-test key prefixes in the shared Redis
// (KeyPrefix, DropKeys), and span collection (RecordSpans,
// StartOTLPReceiver).
//
// When a variable or program is missing a test is skipped, unless
// KVMESH_REQUIRE_SERVICES=1 (set by `make test` and CI), in which case it
// fails: CI never passes by skipping the tests that need real parts.
//
// Benchmarks read the CPU time of processes from the kernel with it
// (ProcessCPU, PostgresCPU, RedisCPU, MachineCPU, CPUMeter).
//
// Only tests import this package. Besides the standard library it depends
// on the Redis and PostgreSQL (pgx) clients and OpenTelemetry (with the
// OTLP protobuf types) only, never on kvmesh packages, so that any
// package's tests may import it.
package testenv

import (
	"errors"
	"fmt"
	"os"
	"testing"
)

// Errors of the package.
var (
	// errServerExited says that a private server (redis-server,
	// prometheus) exited before it was ready.
	errServerExited = errors.New("server exited before it was ready")
	// ErrExited reports a process of a Procs that exited while it was
	// expected to run.
	ErrExited = errors.New("process exited")
	// errRunning reports a Start of a process that is already running.
	errRunning = errors.New("already running")
	// errNotStarted reports a process that was never started.
	errNotStarted = errors.New("not started")
	// errNotListening reports a process whose /readyz answers but whose log
	// does not (yet) say that it listens on its address.
	errNotListening = errors.New("not listening")
	// errDuplicate reports an Add under a name already taken.
	errDuplicate = errors.New("name already registered")
)

// DatabaseURL returns KVMESH_DATABASE_URL or skips/fails the test.
func DatabaseURL(t testing.TB) string {
	t.Helper()
	return need(t, "KVMESH_DATABASE_URL")
}

// RedisURL returns KVMESH_REDIS_URL or skips/fails the test.
func RedisURL(t testing.TB) string {
	t.Helper()
	return need(t, "KVMESH_REDIS_URL")
}

func need(t testing.TB, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v != "" {
		return v
	}
	if os.Getenv("KVMESH_REQUIRE_SERVICES") == "1" {
		t.Fatalf("%s is not set; run tests through `make test` (scripts/devstack.sh up)", name)
	}
	t.Skipf("%s is not set; run `make test` to start PostgreSQL and Redis", name)
	return ""
}

// unavailable skips the test because a real part is missing, or fails it
// when KVMESH_REQUIRE_SERVICES=1.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("KVMESH_REQUIRE_SERVICES") == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}
