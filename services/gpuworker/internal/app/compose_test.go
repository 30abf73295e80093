package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/deploy/composetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// TestComposeEnvMatchesConfig holds docker-compose.yml's gpuworker service(s) to
// Config: only settings Config reads, required ones set, a configuration
// that loads and validates, the contract port published and health-checked,
// and endpoints that lead to services it depends on.
func TestComposeEnvMatchesConfig(t *testing.T) {
	composetest.CheckServiceEnv(t, testenv.ModuleRoot(t), "gpuworker", &app.Config{})
}
