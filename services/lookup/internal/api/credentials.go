package api

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/auth"
)

// allowed checks that the request's credential reaches it: an engine token
// asks only for its own engine, and only for a tenant it serves. Without
// authentication (no principal) every request is allowed.
func allowed(ctx context.Context, req *Request) error {
	p := auth.FromContext(ctx)
	if p == nil || p.Kind != auth.KindEngine {
		return nil
	}
	if p.Subject != req.EngineID {
		return fmt.Errorf("%w: the token is engine %s's; the request names engine %s", auth.ErrForbidden, p.Subject, req.EngineID)
	}
	if !p.AllowsTenant(req.Tenant) {
		return fmt.Errorf("%w: engine %s's token does not serve tenant %q", auth.ErrForbidden, p.Subject, req.Tenant)
	}
	return nil
}

// allowedTenant checks that the request's credential reaches the tenant's
// keys, for routes that act for no engine (POST /v1/score): an engine
// token only for a tenant it serves, the operator token for every tenant.
// Without authentication (no principal) every tenant is allowed.
func allowedTenant(ctx context.Context, tenant string) error {
	p := auth.FromContext(ctx)
	if p == nil || p.AllowsTenant(tenant) {
		return nil
	}
	return fmt.Errorf("%w: engine %s's token does not serve tenant %q", auth.ErrForbidden, p.Subject, tenant)
}

// seesEveryTenant reports whether the request's credential reaches every
// tenant: no principal (no authentication), the operator, or an engine
// token of auth.AnyTenant. Engines' own KV events name no tenant, so their
// scores are only answered to such a credential.
func seesEveryTenant(ctx context.Context) bool {
	p := auth.FromContext(ctx)
	return p == nil || p.Kind != auth.KindEngine || slices.Contains(p.Tenants, auth.AnyTenant)
}
