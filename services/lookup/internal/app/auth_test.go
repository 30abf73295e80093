package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

// TestAdminRoutesRequireToken: the lookup has no admin route; its one
// mutating route, POST /v1/lookup, is the engine API, documented as
// deliberately open, and answers without a token (400 for the empty body,
// not 401 or 403). A mutating route added without being secured or marked
// open fails this test.
func TestAdminRoutesRequireToken(t *testing.T) {
	a := startApp(t)
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, "http://"+a.Addr(), "test-token", a.Routes(), d, nil)
}
