// Package testenv gives tests the addresses of the real servers that
// `make test` starts (PostgreSQL and Redis, via scripts/devstack.sh).
//
// When a variable is missing a test is skipped, unless KVMESH_REQUIRE_SERVICES=1
// (set by `make test` and CI), in which case it fails: CI never passes by
// skipping the tests that need real parts.
package testenv

import (
	"os"
	"testing"
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
