package api

import (
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/evictions"
	"github.com/kvmesh/kvmesh/services/sender/internal/removals"
)

// Removals is the answer of GET /v1/removals.
type Removals = adminapi.Removals

// DefaultRemovalsWindow is the window of GET /v1/removals without since.
const DefaultRemovalsWindow = time.Hour

// removalCauses are the causes GET /v1/removals filters on.
var removalCauses = []string{evictions.CauseEvicted, evictions.CauseExpired, evictions.CauseDeleted, evictions.CauseQuota, evictions.CauseFlushed}

// listRemovals answers what left the store: for one tenant (tenant=, ""
// for the tenant-less key space) or all, of one cause or all, in the last
// since (a duration, default an hour, at most the log's retention), summed
// per cause, with the newest limit records.
func (a *API) listRemovals(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	now := time.Now()
	f := removals.Filter{Until: now, Cause: q.Get("cause")}
	if q.Has("tenant") {
		t := q.Get("tenant")
		if err := kvcore.ValidateTenant(t); err != nil {
			httpserver.BadParameter(w, r, "tenant", err.Error())
			return
		}
		f.Tenant = &t
	}
	if f.Cause != "" && !slices.Contains(removalCauses, f.Cause) {
		httpserver.BadParameter(w, r, "cause", fmt.Sprintf("cause %q is not one of %v", f.Cause, removalCauses))
		return
	}
	window := DefaultRemovalsWindow
	if v := q.Get("since"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 || d > a.removed.Retention() {
			httpserver.BadParameter(w, r, "since", fmt.Sprintf("since %q must be a duration such as 1h or 15m, at most the retention %s", v, a.removed.Retention()))
			return
		}
		window = d
	}
	f.Since = now.Add(-window)
	var ok bool
	if f.Limit, ok = httpserver.PageLimit(w, r); !ok {
		return
	}
	out, err := a.removed.Query(r.Context(), f)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	a.write(w, http.StatusOK, out)
}
