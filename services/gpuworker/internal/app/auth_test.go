package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// TestAdminRoutesRequireToken: with authentication required, every route
// but the probes answers 401 without a token or with a wrong one; the
// operator token runs the admin routes (POST /v1/pool/reset, the pool and
// device reads) and is refused (403) on the engine's routes (KV memory,
// write, read, evict) and the sender's put.
func TestAdminRoutesRequireToken(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-auth")
	cfg.Common.Auth = env.SecuredCommon().Auth
	w := startWorker(t, cfg, nil)
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, "http://"+w.app.Addr(), "test-token", w.app.Routes(), d, nil)
}
