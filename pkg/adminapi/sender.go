package adminapi

import (
	"encoding/json"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// DryRun says what a replay of a dead letter would do now.
type DryRun struct {
	// Replayable is set when the payload is valid for the current model and
	// the entry was not replayed before.
	Replayable bool `json:"replayable"`
	// Expect is already_replayed, invalid, save or fail.
	Expect string `json:"expect"`
	// Reason and Detail say why the entry is invalid or the save would fail.
	Reason string `json:"reason,omitempty"`
	Detail string `json:"detail,omitempty"`
	// Group is the group found invalid (nil: the record as a whole).
	Group *int `json:"group,omitempty"`
	// Groups are the groups a replay would save, with their keys.
	Groups []DryRunGroup `json:"groups,omitempty"`
}

// DryRunGroup is one group a replay would save.
type DryRunGroup struct {
	// Group is the KV-group index.
	Group int `json:"group"`
	// Existing and Missing count the keys the store holds and lacks
	// (both 0 when the existence check failed).
	Existing int `json:"existing"`
	Missing  int `json:"missing"`
	// Keys are the group's keys on every rank namespace.
	Keys []DryRunKey `json:"keys"`
}

// DryRunKey is one store key a replay would check and, when missing, put.
type DryRunKey struct {
	// Key is the store key.
	Key string `json:"key"`
	// Rank names the worker rank that writes the key (for a group whose
	// ranks share a namespace, such as MLA, not the key's tp_rank), e.g.
	// "tp3-pcp0-dcp0-pp0".
	Rank string `json:"rank"`
	// Block is the engine block the gpuworker would put.
	Block kvcore.BlockID `json:"block"`
	// Exists says whether the store holds the key; nil when the existence
	// check failed.
	Exists *bool `json:"exists"`
}

// DryRunAnswer is the answer of POST /v1/dlq/{id}/replay?dry_run=true.
type DryRunAnswer struct {
	// ID is the dead letter's id.
	ID int64 `json:"id"`
	// Simulated is always true (member dry_run): nothing was saved,
	// recorded or published.
	Simulated bool `json:"dry_run"`
	// ReplayStatus and ReplayCount are the entry's, unchanged.
	ReplayStatus string `json:"replay_status"`
	ReplayCount  int    `json:"replay_count"`
	DryRun
}

// Accounting sums the sender's save outcomes and dead letters.
type Accounting struct {
	// Tasks counts completed save tasks by status (and in total).
	Tasks map[string]int64 `json:"tasks"`
	// Groups counts task groups by outcome.
	Groups map[string]int64 `json:"groups"`
	// Keys counts store keys by outcome.
	Keys map[string]int64 `json:"keys"`
	// Bytes is the value bytes stored.
	Bytes int64 `json:"bytes"`
	// DeadLetters counts dead letters by reason (and in total).
	DeadLetters map[string]int64 `json:"dead_letters"`
}

// PressureState is the state of a sender's store-pressure gate. Pressure
// is scoped to the requests whose puts the store answered "no space".
type PressureState struct {
	// Active is set while some request is under store pressure.
	Active bool `json:"active"`
	// Requests is the number of requests under pressure now (their saves
	// are skipped, and saved again by their next save).
	Requests int `json:"requests"`
	// SkippedTasks counts tasks skipped by the gate since start.
	SkippedTasks int64 `json:"skipped_tasks"`
	// SkippedKeys counts keys not saved because of store pressure since start.
	SkippedKeys int64 `json:"skipped_keys"`
	// Episodes counts how often pressure began (no request under pressure
	// before) since start.
	Episodes int64 `json:"episodes"`
	// Released counts the requests let go from pressure since start to
	// keep the gate within its bound of requests (they are put as usual).
	Released int64 `json:"released"`
}

// SenderStats is the answer of the sender's GET /v1/stats.
type SenderStats struct {
	Accounting
	// Pressure is the pressure gate of this process.
	Pressure PressureState `json:"pressure"`
	// At is when the stats were read.
	At time.Time `json:"at"`
}

// Worker states of GET /v1/workers.
const (
	// WorkerAlive: the last heartbeat is newer than the stale-after age;
	// the sender routes puts through this worker.
	WorkerAlive = "alive"
	// WorkerStale: the last heartbeat is older; the sender treats the
	// worker as gone.
	WorkerStale = "stale"
)

// Worker is one registered gpuworker as the sender's GET /v1/workers shows
// it; it is also the workers-table row that pkg/registry reads and writes
// (registry.Worker).
type Worker struct {
	// EngineID and Rank identify the worker.
	EngineID string      `json:"engine_id"`
	Rank     kvcore.Rank `json:"rank"`
	// Addr is the base URL of its HTTP API and data plane.
	Addr string `json:"addr"`
	// RegisteredAt and HeartbeatAt are the registration and the last
	// heartbeat (database clock).
	RegisteredAt time.Time `json:"registered_at"`
	HeartbeatAt  time.Time `json:"heartbeat_at"`
	// HeartbeatAgeSeconds is the age of the last heartbeat.
	HeartbeatAgeSeconds float64 `json:"heartbeat_age_seconds"`
	// State is WorkerAlive or WorkerStale; Alive says the same as a boolean.
	State string `json:"state"`
	Alive bool   `json:"alive"`
	// Devices is the GPU inventory the worker registered with.
	Devices json.RawMessage `json:"devices"`
}

// WorkerPage is one page of GET /v1/workers.
type WorkerPage struct {
	// Items are the workers in (engine id, tp, pcp, dcp, pp) order.
	Items []Worker `json:"items"`
	// NextCursor fetches the next page; absent on the last one.
	NextCursor string `json:"next_cursor,omitempty"`
	// StaleAfterSeconds is the heartbeat age past which a worker is stale.
	StaleAfterSeconds float64 `json:"stale_after_seconds"`
}

// RemovalCause sums the removals of one cause in GET /v1/removals.
type RemovalCause struct {
	// Cause is why the blocks left: evicted, expired, del, or flushed (the
	// whole store was found flushed; Blocks is then 0: not known).
	Cause string `json:"cause"`
	// Blocks is how many blocks left for it.
	Blocks int64 `json:"blocks"`
	// AgesKnown is how many of them had a store time; the ages below are
	// theirs (absent when none had).
	AgesKnown int64    `json:"ages_known"`
	AgeMinS   *float64 `json:"age_min_s,omitempty"`
	AgeAvgS   *float64 `json:"age_avg_s,omitempty"`
	AgeMaxS   *float64 `json:"age_max_s,omitempty"`
}

// Removal is one published BlockRemoved record of GET /v1/removals: the
// blocks of one store namespace that left for one cause.
type Removal struct {
	ID          int64     `json:"id"`
	RemovedAt   time.Time `json:"removed_at"`
	Model       string    `json:"model"`
	Fingerprint string    `json:"fingerprint"`
	Tenant      string    `json:"tenant"`
	Namespace   string    `json:"namespace"`
	Cause       string    `json:"cause"`
	Blocks      int       `json:"blocks"`
	AgesKnown   int       `json:"ages_known"`
	AgeMinS     *float64  `json:"age_min_s,omitempty"`
	AgeMaxS     *float64  `json:"age_max_s,omitempty"`
}

// Removals is the answer of the sender's GET /v1/removals: what left the
// store in a window, for one tenant or all, by cause and newest first.
type Removals struct {
	// Tenant is the tenant asked about; absent for every tenant ("" is
	// the tenant-less key space).
	Tenant *string `json:"tenant,omitempty"`
	// Cause is the cause asked about; absent for every cause.
	Cause string `json:"cause,omitempty"`
	// Since and Until bound the window (removed_at in [Since, Until)).
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
	// ByCause sums the window's removals per cause.
	ByCause []RemovalCause `json:"by_cause"`
	// Recent are the window's newest records, at most the limit asked.
	Recent []Removal `json:"recent"`
}

// What a save that would take a tenant over its quota does (TenantQuota.OnFull).
const (
	// QuotaEvict removes the tenant's own least recently used blocks to
	// make room (the default).
	QuotaEvict = "evict"
	// QuotaSkip skips the save's blocks that do not fit, with reason quota.
	QuotaSkip = "skip"
)

// TenantQuota is a tenant's quota in the store: the body of the sender's
// PUT /v1/quotas/{tenant} and part of every answer about it.
type TenantQuota struct {
	// Tenant is the tenant (a request's tenant, never empty).
	Tenant string `json:"tenant"`
	// MaxBytes bounds the bytes of the tenant's values in the store (0:
	// unlimited).
	MaxBytes int64 `json:"max_bytes,omitempty"`
	// MaxKeys bounds the tenant's keys in the store (0: unlimited).
	MaxKeys int64 `json:"max_keys,omitempty"`
	// OnFull is QuotaEvict or QuotaSkip (empty: QuotaEvict).
	OnFull string `json:"on_full,omitempty"`
	// UpdatedAt is when the quota was last set (answers only).
	UpdatedAt time.Time `json:"updated_at,omitzero"`
}

// QuotaStatus is a tenant's quota and what it holds: GET
// /v1/quotas/{tenant}, and each item of GET /v1/quotas.
type QuotaStatus struct {
	TenantQuota
	// UsageBytes and UsageKeys are what the tenant holds in the store now,
	// from its namespaces' store-time indexes.
	UsageBytes int64 `json:"usage_bytes"`
	UsageKeys  int64 `json:"usage_keys"`
	// EvictedBlocks and SkippedBlocks count the tenant's blocks this
	// sender replica removed, and the blocks of its saves it skipped, to
	// keep the tenant within its quota since it started.
	EvictedBlocks int64 `json:"evicted_blocks"`
	SkippedBlocks int64 `json:"skipped_blocks"`
}

// Quotas is the answer of the sender's GET /v1/quotas: every tenant with
// a quota, by name.
type Quotas struct {
	Items []QuotaStatus `json:"items"`
}
