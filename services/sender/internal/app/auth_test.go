package app_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// TestAdminRoutesRequireToken: with authentication required, every route
// the sender serves but the probes is secured in its document and answers
// 401 without a token or with a wrong one; the operator token reaches the
// handler (404 for an unknown id).
// The dry run of a replay is the same route and is guarded the same way.
func TestAdminRoutesRequireToken(t *testing.T) {
	a := startAppWith(t, map[string]string{"KVMESH_AUTH": "required", "KVMESH_AUTH_KEY": servicetest.AuthKey})
	base := "http://" + a.Addr()
	d := servicetest.ParseOpenAPI(t, app.OpenAPI)
	servicetest.CheckAdminAuth(t, base, adminToken, a.Routes(), d, map[string]string{"id": "999999", "tenant": "acme"})

	for auth, want := range map[string]int{
		"": http.StatusUnauthorized, "Bearer nope": http.StatusUnauthorized, "Bearer " + adminToken: http.StatusNotFound,
	} {
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, base+"/v1/dlq/999999/replay?dry_run=true", nil)
		if err != nil {
			t.Fatal(err)
		}
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("dry run with %q: %d, want %d", auth, resp.StatusCode, want)
		}
	}
}
