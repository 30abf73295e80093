package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// TestOpenAPIMatchesRoutes: the document served at /openapi.yaml is the
// embedded one and documents exactly the routes the router serves.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	a := startApp(t)
	servicetest.CheckServedOpenAPI(t, a.Addr(), a.Routes(), app.OpenAPI)
}
