package sim

import (
	"maps"
	"slices"
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
