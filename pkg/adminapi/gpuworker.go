package adminapi

import "github.com/kvmesh/kvmesh/pkg/kvcore"

// PoolAnswer is the body of a gpuworker's GET /v1/pool.
type PoolAnswer struct {
	// EngineID and Rank name the pool.
	EngineID string      `json:"engine_id"`
	Rank     kvcore.Rank `json:"rank"`
	// Model and Fingerprint name the model the pool is laid out for.
	Model       string `json:"model"`
	Fingerprint string `json:"fingerprint"`
	// DataplaneURL is where the worker's data plane listens.
	DataplaneURL string `json:"dataplane_url"`
	// Groups describe each KV group's pool.
	Groups []PoolGroup `json:"groups"`
}

// PoolGroup is one KV group's pool and its occupancy.
type PoolGroup struct {
	// Group is the KV-group index.
	Group int `json:"group"`
	// Kind is the group's attention kind.
	Kind kvcore.Kind `json:"kind"`
	// Blocks is the number of blocks.
	Blocks int `json:"blocks"`
	// BytesPerBlock is the size of one block.
	BytesPerBlock int64 `json:"bytes_per_block"`
	// BytesTotal is Blocks × BytesPerBlock.
	BytesTotal int64 `json:"bytes_total"`
	// InUse counts blocks that hold an identity (written by a write or a
	// load, and not evicted, reset or torn since).
	InUse int `json:"in_use"`
}
