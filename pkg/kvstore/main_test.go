package kvstore_test

import (
	"os"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// TestMain stops the shared Redis Cluster, if a test started one, once
// every test has run.
func TestMain(m *testing.M) {
	code := m.Run()
	testenv.StopRedisClusters()
	os.Exit(code)
}
