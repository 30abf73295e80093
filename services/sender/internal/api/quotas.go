package api

import (
	"errors"
	"net/http"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/quotas"
)

// Quotas is the answer of GET /v1/quotas.
type Quotas = adminapi.Quotas

// WithQuotas serves the tenants' quotas from e (GET, PUT and DELETE
// /v1/quotas…); nil serves none (a store that keeps no quotas).
func (a *API) WithQuotas(e *quotas.Enforcer) *API {
	a.quotas = e
	return a
}

// mountQuotas adds the quota routes, all behind admin (they name tenants).
func (a *API) mountQuotas(r chi.Router, admin func(http.Handler) http.Handler) {
	if a.quotas == nil {
		return
	}
	r.With(admin).Get("/v1/quotas", a.listQuotas)
	r.With(admin).Get("/v1/quotas/{tenant}", a.getQuota)
	r.With(admin).Put("/v1/quotas/{tenant}", a.putQuota)
	r.With(admin).Delete("/v1/quotas/{tenant}", a.deleteQuota)
}

// listQuotas answers every tenant's quota with its usage.
func (a *API) listQuotas(w http.ResponseWriter, r *http.Request) {
	out, err := a.quotas.List(r.Context())
	if err != nil {
		a.internal(w, r, err)
		return
	}
	a.write(w, http.StatusOK, out)
}

// getQuota answers one tenant's quota with its usage.
func (a *API) getQuota(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenantParam(w, r)
	if !ok {
		return
	}
	out, err := a.quotas.Status(r.Context(), tenant)
	if a.quotaErr(w, r, err) {
		return
	}
	a.write(w, http.StatusOK, out)
}

// putQuota sets one tenant's quota (the body's tenant, if given, must be
// the path's) and answers it as stored.
func (a *API) putQuota(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenantParam(w, r)
	if !ok {
		return
	}
	var q adminapi.TenantQuota
	if err := httpserver.DecodeJSON(w, r, &q); err != nil {
		return
	}
	if q.Tenant != "" && q.Tenant != tenant {
		httpserver.BadParameter(w, r, "tenant", "the body's tenant "+q.Tenant+" is not the path's "+tenant)
		return
	}
	q.Tenant = tenant
	out, err := a.quotas.Set(r.Context(), q)
	if a.quotaErr(w, r, err) {
		return
	}
	a.log.InfoContext(r.Context(), "tenant quota set", "tenant", out.Tenant, "max_bytes", out.MaxBytes, "max_keys", out.MaxKeys, "on_full", out.OnFull)
	a.write(w, http.StatusOK, out)
}

// deleteQuota removes one tenant's quota.
func (a *API) deleteQuota(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenantParam(w, r)
	if !ok {
		return
	}
	if a.quotaErr(w, r, a.quotas.Delete(r.Context(), tenant)) {
		return
	}
	a.log.InfoContext(r.Context(), "tenant quota removed", "tenant", tenant)
	w.WriteHeader(http.StatusNoContent)
}

// tenantParam is the path's tenant, or a 400 written.
func tenantParam(w http.ResponseWriter, r *http.Request) (string, bool) {
	t := chi.URLParam(r, "tenant")
	if err := kvcore.ValidateTenant(t); err != nil {
		httpserver.BadParameter(w, r, "tenant", err.Error())
		return "", false
	}
	return t, true
}

// quotaErr writes the answer of a failed quota call: 400 for an invalid
// quota, 404 for a tenant without one, 500 otherwise. It reports whether
// err was one.
func (a *API) quotaErr(w http.ResponseWriter, r *http.Request, err error) bool {
	switch {
	case err == nil:
		return false
	case errors.Is(err, quotas.ErrInvalid):
		httpserver.WriteProblem(w, r, http.StatusBadRequest, "", err.Error(), nil)
	case errors.Is(err, quotas.ErrNotFound):
		httpserver.WriteProblem(w, r, http.StatusNotFound, "", err.Error(), nil)
	default:
		a.internal(w, r, err)
	}
	return true
}
