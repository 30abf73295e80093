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

// allowedScore checks that the request's credential may score it, for
// routes that act for no engine (POST /v1/score): an engine token reaches
// only the tenants it serves, and, when the request names an engine, only
// its own engine (as a lookup's credential must be its engine's); the
// operator reaches every tenant.
func allowedScore(ctx context.Context, req *Request) error {
	p := auth.FromContext(ctx)
	switch {
	case p == nil || p.Kind != auth.KindEngine:
		return nil
	case req.EngineID != "" && p.Subject != req.EngineID:
		return fmt.Errorf("%w: the token is engine %s's; the request names engine %s", auth.ErrForbidden, p.Subject, req.EngineID)
	case !p.AllowsTenant(req.Tenant):
		return fmt.Errorf("%w: engine %s's token does not serve tenant %q", auth.ErrForbidden, p.Subject, req.Tenant)
	}
	return nil
}

// seesEveryTenant reports whether the request's credential reaches every
// tenant: no principal (no authentication), the operator, or an engine
// token of auth.AnyTenant. Engines' own KV events name no tenant, so their
// scores are only answered to such a credential.
func seesEveryTenant(ctx context.Context) bool {
	p := auth.FromContext(ctx)
	return p == nil || p.Kind != auth.KindEngine || slices.Contains(p.Tenants, auth.AnyTenant)
}
