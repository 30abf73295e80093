package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// TestAdminRoutesRequireToken: the scheduler's admin API is read-only; a
// mutating route added without being secured in the document (or marked
// deliberately open) fails this test, and a secured one is probed for
// 401/403.
func TestAdminRoutesRequireToken(t *testing.T) {
	a := startApp(t)
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, "http://"+a.Addr(), "test-token", a.Routes(), d, nil)
}
