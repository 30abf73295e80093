package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// TestAdminRoutesRequireToken: POST /v1/pool/reset answers 401 without a
// token and 403 with a wrong one, and resets with the right one; the data
// plane's POST routes are documented as deliberately open
// (x-kvmesh-public: cluster-internal) and do not ask for a token.
func TestAdminRoutesRequireToken(t *testing.T) {
	t.Parallel()
	w := startWorker(t, testConfig(servicetest.NewEnv(t), "engine-auth"), nil)
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, "http://"+w.app.Addr(), "test-token", w.app.Routes(), d, nil)
}
