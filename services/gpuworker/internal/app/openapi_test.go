package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// TestOpenAPIMatchesRoutes: the document served at /openapi.yaml is the
// embedded one and documents exactly the routes the router serves, data
// plane included.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	t.Parallel()
	w := startWorker(t, testConfig(servicetest.NewEnv(t), "engine-openapi"), nil)
	servicetest.CheckServedOpenAPI(t, w.app.Addr(), w.app.Routes(), app.OpenAPI)
}
