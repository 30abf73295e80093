package adminapi

// The lookup's answers.

// ScoreResponse is the answer of POST /v1/score.
type ScoreResponse struct {
	// Model is the served model.
	Model string `json:"model"`
	// Tenant is the tenant whose keys were scored; absent for no tenant.
	Tenant string `json:"tenant,omitempty"`
	// NumTokens is the prompt's token count.
	NumTokens int `json:"num_tokens"`
	// Store is the store pool's score.
	Store TierScore `json:"store"`
	// Engines are the engines' own prefix caches' scores, by engine id,
	// from their KV events, under the same rules; absent when engine
	// scores are off, for a tenant-scoped credential, or before any engine
	// published.
	Engines map[string]TierScore `json:"engines,omitempty"`
}

// TierScore is one source's score of a prompt (kvcore.Score).
type TierScore struct {
	// HitTokens is the hybrid longest hit, as /v1/lookup's store child
	// finds it before subtracting num_computed_tokens.
	HitTokens int `json:"hit_tokens"`
	// AnyGroupPrefixTokens is what a router folding every group into one
	// key counts.
	AnyGroupPrefixTokens int `json:"any_group_prefix_tokens"`
	// Groups are the per-group counts, in group-index order.
	Groups []GroupScore `json:"groups"`
}

// GroupScore is one KV-cache group's counts (kvcore.GroupScore).
type GroupScore struct {
	// Group is the group index.
	Group int `json:"group"`
	// Kind is vLLM's kv_cache_spec_kind of the group.
	Kind string `json:"kind"`
	// BlockSize is the group's block size in tokens.
	BlockSize int `json:"block_size"`
	// PrefixTokens is the run of the group's blocks held from token 0.
	PrefixTokens int `json:"prefix_tokens"`
	// UsableTokens is the longest hit the group alone could serve.
	UsableTokens int `json:"usable_tokens"`
}
