package sim

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

// TenantCounts are one tenant's figures of a run with tenants
// (Workload.Tenants): what its admissions found where. StoreLoadedTokens
// can only come from the tenant's own saves, since a lookup checks only
// the tenant's keys.
type TenantCounts struct {
	// Tenant is the tenant's name.
	Tenant string `json:"tenant"`
	// Admissions counts the tenant's admissions (a preempted request is
	// admitted again); FirstTurnAdmissions those of conversations' first
	// turns.
	Admissions          int `json:"admissions"`
	FirstTurnAdmissions int `json:"first_turn_admissions"`
	// PromptTokens sums the admissions' prompt tokens; LocalHitTokens the
	// engine's own prefix-cache hits among them.
	PromptTokens   int `json:"prompt_tokens"`
	LocalHitTokens int `json:"local_hit_tokens"`
	// StoreLoadedTokens are the external tokens loaded from the store;
	// FirstTurnStoreLoadedTokens the part of them loaded for first turns
	// (which no earlier turn of the conversation stored).
	StoreLoadedTokens          int `json:"store_loaded_tokens"`
	FirstTurnStoreLoadedTokens int `json:"first_turn_store_loaded_tokens"`
	// StoredKeys counts the distinct store keys the tenant's saves stored
	// (the run's BlockStored events), each in the tenant's key space.
	StoredKeys int `json:"stored_keys"`
	// Store is what the sender says of the tenant after the run (when the
	// run asks the sender).
	Store *TenantStore `json:"store,omitempty"`
}

// tenantLocked counts one admission of tenant: num prompt tokens, local of
// them in the prefix cache, ext external tokens from connector conn; first
// marks a conversation's first turn. s.mu must be held.
func (s *stats) tenantLocked(tenant string, first bool, num, local, ext int, conn string) {
	if s.tenants == nil {
		s.tenants = map[string]*TenantCounts{}
	}
	c := s.tenants[tenant]
	if c == nil {
		c = &TenantCounts{Tenant: tenant}
		s.tenants[tenant] = c
	}
	c.Admissions++
	c.PromptTokens += num
	c.LocalHitTokens += local
	if first {
		c.FirstTurnAdmissions++
	}
	if conn == "store" && ext > 0 {
		c.StoreLoadedTokens += ext
		if first {
			c.FirstTurnStoreLoadedTokens += ext
		}
	}
}

// tenantsLocked lists the tenants' figures in tenant order, each with the
// keys its saves stored (storedKeys, by tenant); nil for a run without
// tenants. s.mu must be held.
func (s *stats) tenantsLocked(storedKeys map[string]int) []TenantCounts {
	if len(s.tenants) == 0 {
		return nil
	}
	out := make([]TenantCounts, 0, len(s.tenants))
	for _, t := range slices.Sorted(maps.Keys(s.tenants)) {
		c := *s.tenants[t]
		c.StoredKeys = storedKeys[t]
		out = append(out, c)
	}
	return out
}

// TenantStore is what the sender says of one tenant after a run: its
// quota (absent when it has none), what it holds in the store and what of
// it was removed during the run, by cause.
type TenantStore struct {
	// Quota is the tenant's quota and usage (GET /v1/quotas/{tenant});
	// nil when the tenant has none.
	Quota *adminapi.QuotaStatus `json:"quota,omitempty"`
	// Removed counts the tenant's blocks removed from the store since the
	// run began, by cause (GET /v1/removals).
	Removed map[string]int64 `json:"removed"`
	// Error says why the sender could not be asked.
	Error string `json:"error,omitempty"`
}

// HitRate is the share of the tenant's prompt tokens found cached: in the
// engine's prefix cache or loaded from the store.
func (c TenantCounts) HitRate() float64 {
	if c.PromptTokens == 0 {
		return 0
	}
	return float64(c.LocalHitTokens+c.StoreLoadedTokens) / float64(c.PromptTokens)
}

// checkTenantStores asks the sender (any of its replicas) about each
// tenant of the run: its quota and usage, and its removals in the last
// since, and puts them in the tenants' counts.
func checkTenantStores(ctx context.Context, hc *http.Client, reps *replicas, tenants []TenantCounts, since time.Duration) {
	window := since.Round(time.Second) + time.Minute
	for i := range tenants {
		tenants[i].Store = tenantStore(ctx, hc, reps, tenants[i].Tenant, window)
	}
}

// tenantStore is the sender's answer about one tenant.
func tenantStore(ctx context.Context, hc *http.Client, reps *replicas, tenant string, window time.Duration) *TenantStore {
	st := &TenantStore{Removed: map[string]int64{}}
	var q adminapi.QuotaStatus
	err := reps.do(ctx, replicaDown, func(base string) error {
		return getJSON(ctx, hc, base+"/v1/quotas/"+url.PathEscape(tenant), &q)
	})
	switch {
	case err == nil:
		st.Quota = &q
	case !errors.Is(err, errNotFound):
		st.Error = err.Error()
		return st
	}
	var rm adminapi.Removals
	q2 := url.Values{"tenant": {tenant}, "since": {window.String()}, "limit": {"1"}}
	if err := reps.do(ctx, replicaDown, func(base string) error {
		return getJSON(ctx, hc, base+"/v1/removals?"+q2.Encode(), &rm)
	}); err != nil {
		st.Error = err.Error()
		return st
	}
	for _, c := range rm.ByCause {
		st.Removed[c.Cause] = c.Blocks
	}
	return st
}

// text is the store part of a tenant's report row: its quota and usage,
// and its removals by cause.
func (s *TenantStore) text() string {
	if s == nil {
		return ""
	}
	if s.Error != "" {
		return "; sender: " + s.Error
	}
	out := "; quota none"
	if q := s.Quota; q != nil {
		out = fmt.Sprintf("; quota %s/%s keys (%s): usage %s, %d keys; %d evicted, %d skipped",
			limitText(size(q.MaxBytes), q.MaxBytes), limitText(fmt.Sprint(q.MaxKeys), q.MaxKeys), q.OnFull,
			size(q.UsageBytes), q.UsageKeys, q.EvictedBlocks, q.SkippedBlocks)
	}
	causes := slices.Sorted(maps.Keys(s.Removed))
	parts := make([]string, 0, len(causes))
	for _, c := range causes {
		parts = append(parts, fmt.Sprintf("%s %d", c, s.Removed[c]))
	}
	if len(parts) == 0 {
		parts = []string{"none"}
	}
	return out + "; removed " + strings.Join(parts, ", ")
}

// limitText is text, or "unlimited" for a zero limit.
func limitText(text string, limit int64) string {
	if limit == 0 {
		return "unlimited"
	}
	return text
}
