package service

import (
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

// The settings several programs share, each declared once: a service's
// Config embeds those it reads (Common embeds the ones every service
// reads), and the kvmesh command reads them through the same structs
// (config.Overlay) for the defaults of its flags. Embedded, their fields
// are the Config's own (cfg.HTTPAddr, cfg.DatabaseURL, ...).

// HTTP is a service's listen address. It has no default of its own: each
// service's SetDefaults gives its contract address (contract.LookupAddr,
// ...).
type HTTP struct {
	// HTTPAddr is the API and health listen address.
	HTTPAddr string `env:"KVMESH_HTTP_ADDR" doc:"listen address of the service's HTTP API (a gpuworker serves its data plane there too)"`
}

// Database locates PostgreSQL.
type Database struct {
	// DatabaseURL locates PostgreSQL.
	DatabaseURL string `env:"KVMESH_DATABASE_URL" secret:"true" required:"true" doc:"PostgreSQL URL (postgres://user:pass@host:port/db)"`
}

// Store locates the store pool (Redis) and holds its TLS settings.
type Store struct {
	// RedisURL locates the store pool.
	RedisURL string `env:"KVMESH_REDIS_URL" secret:"true" required:"true" doc:"store pool URL: redis://host:port/db for one server (rediss:// for TLS), or redis+cluster://host:port,host:port,... for a Redis Cluster (rediss+cluster:// for TLS)"`
	// RedisTLS are the CA bundle, client certificate and server name of a
	// rediss:// store pool (KVMESH_REDIS_CA_FILE, ...).
	kvstore.RedisTLS
}

// Tier locates the capacity tier: an S3-compatible bucket below Redis
// (pkg/kvtier). The gpuworkers write every stored block behind Redis into
// it and load from it what Redis no longer holds; the lookup counts a
// block present there once its object is confirmed.
type Tier struct {
	// TierURL is http(s)://host[:port]/bucket[/prefix].
	TierURL string `env:"KVMESH_TIER_URL" doc:"capacity tier below Redis: the S3 API URL and bucket, http(s)://host:port/bucket[/prefix] (path-style); empty: no tier, blocks live in Redis only. Every lookup and gpuworker of a mesh must name the same; the bucket must exist"`
	// TierAccessKey is the S3 access key.
	TierAccessKey string `env:"KVMESH_TIER_ACCESS_KEY" secret:"true" doc:"S3 access key of the capacity tier"`
	// TierSecretKey is the S3 secret key.
	TierSecretKey string `env:"KVMESH_TIER_SECRET_KEY" secret:"true" doc:"S3 secret key of the capacity tier"`
	// TierRegion is the bucket's region.
	TierRegion string `env:"KVMESH_TIER_REGION" doc:"region of the capacity tier's bucket (SigV4 signing)"`
	// TierQueueBytes bounds the write-behind queue.
	TierQueueBytes int64 `env:"KVMESH_TIER_QUEUE_BYTES" doc:"bytes of stored blocks a gpuworker may hold waiting to be written behind Redis into the tier; a block that finds the queue full stays in Redis only (kvmesh_tier_writes_total{result=\"dropped\"})"`
	// TierTimeout bounds one object call.
	TierTimeout time.Duration `env:"KVMESH_TIER_TIMEOUT" doc:"bound of one object call to the capacity tier (a slower one fails: a load from it fails and the engine recomputes, a confirmation counts the block absent)"`
}

// SetDefaults gives the tier's region, queue and timeout (config.Defaulter).
func (t *Tier) SetDefaults() {
	t.TierRegion, t.TierQueueBytes, t.TierTimeout = "us-east-1", kvtier.DefaultQueueBytes, 5*time.Second
}

// KVEvents is the wire form of the vLLM events in the records the sender
// (BlockStored of Redis's blocks, BlockRemoved, AllBlocksCleared) and the
// gpuworkers (BlockStored of the capacity tier's blocks) write to
// kvmesh.kv.events: one topic, read by one consumer, so one setting.
type KVEvents struct {
	// KVEventsForm is the wire form of the events on kvmesh.kv.events.
	KVEventsForm contract.KVEventForm `env:"KVMESH_KV_EVENTS_FORM" doc:"wire form of the vLLM events in the kvmesh.kv.events records the sender (BlockStored, BlockRemoved, AllBlocksCleared) and the gpuworkers (BlockStored of the capacity tier's blocks) write: map (each event a map tagged under \"type\", as vLLM writes them since vllm-project/vllm#42892; the only form with locality) or array (vLLM's older positional array_like events, the only form llm-d-kv-cache up to v0.8.1 decodes); the same in the sender and every gpuworker, which refuse to start on any other value"`
}

// SetDefaults gives the map form (config.Defaulter).
func (k *KVEvents) SetDefaults() { k.KVEventsForm = contract.KVEventFormMap }

// Validate checks the form, naming the setting.
func (k *KVEvents) Validate() error {
	if err := k.KVEventsForm.Validate(); err != nil {
		return fmt.Errorf("KVMESH_KV_EVENTS_FORM: %w", err)
	}
	return nil
}

// Workers is how the services that call gpuworkers judge the worker
// registry.
type Workers struct {
	// WorkerStaleAfter is how old a gpuworker heartbeat may be.
	WorkerStaleAfter time.Duration `env:"KVMESH_WORKER_STALE_AFTER" doc:"a gpuworker whose last heartbeat is older is treated as gone (the sender sends it no puts, a gpuworker does not use it as a pd load source)"`
}

// SetDefaults gives the registry's staleness (config.Defaulter).
func (w *Workers) SetDefaults() { w.WorkerStaleAfter = registry.DefaultStaleAfter }

// PublishOnCommit is the switch of the outbox's publish on commit
// (database.Direct) in the services that write the outbox.
type PublishOnCommit struct {
	// NoPublishOnCommit leaves every message to the outbox relay (the zero
	// value publishes the process's own on commit).
	NoPublishOnCommit bool `env:"KVMESH_OUTBOX_PUBLISH_ON_COMMIT_DISABLED" doc:"operator switch: true leaves every message this service commits to the outbox (tasks and feedback, save results, KV events, dead letters) to the outbox relay, woken through PostgreSQL and claimed per batch, instead of publishing it from this process right after its transaction commits; the scheduler's is off too while KVMESH_OUTBOX_RELAY_DISABLED is true"`
}

// KafkaBrokers are the Kafka bootstrap brokers.
type KafkaBrokers struct {
	// Brokers are the Kafka bootstrap brokers.
	Brokers []string `env:"KVMESH_KAFKA_BROKERS" doc:"Kafka bootstrap brokers, comma-separated"`
}

// SetDefaults gives the contract's broker address (config.Defaulter).
func (b *KafkaBrokers) SetDefaults() { b.Brokers = []string{contract.BrokerAddr} }

// Admin is the operator token.
type Admin struct {
	// AdminToken guards mutating admin routes.
	AdminToken string `env:"KVMESH_ADMIN_TOKEN" secret:"true" doc:"the operator token: bearer token of the admin routes (with KVMESH_AUTH=off only their mutations need it); when unset they are refused"`
}

// ModelSpec names the models a mesh serves: the default one, which every
// service and the kvmesh command lay the KV cache out for (a gpuworker:
// its engine's), and the others the lookup, the scheduler and the sender
// serve beside it.
type ModelSpec struct {
	// Model is a preset name or the path of a YAML/JSON model spec.
	Model string `env:"KVMESH_MODEL" doc:"model spec: a preset name (dense, hybrid-mla-linear, hybrid-mla-linear-tp8, full-swa-mamba) or a YAML/JSON file; the mesh's default model, and a gpuworker's engine's model"`
	// Models are more models the mesh serves.
	Models []string `env:"KVMESH_MODELS" doc:"more models the mesh serves beside KVMESH_MODEL, comma-separated presets or spec files, each at its spec's parallel layout (KVMESH_TP/PCP/DCP/PP apply to KVMESH_MODEL only); every lookup, scheduler and sender of the mesh must list the same, and each engine names its model (vLLM's served model name) in every request. Empty: KVMESH_MODEL only"`
}

// DefaultModel is KVMESH_MODEL's default preset.
const DefaultModel = "hybrid-mla-linear"

// SetDefaults gives DefaultModel (config.Defaulter).
func (m *ModelSpec) SetDefaults() { m.Model = DefaultModel }

// Telemetry is where traces are exported (OpenTelemetry's own variables).
type Telemetry struct {
	// OTLPEndpoint is the OTLP/HTTP collector base URL.
	OTLPEndpoint string `env:"OTEL_EXPORTER_OTLP_ENDPOINT" doc:"OTLP/HTTP collector base URL (e.g. http://collector:4318); unset exports no traces"`
	// OTLPTracesEndpoint is a full OTLP/HTTP traces URL that wins over OTLPEndpoint.
	OTLPTracesEndpoint string `env:"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" doc:"full OTLP/HTTP traces URL; wins over OTEL_EXPORTER_OTLP_ENDPOINT"`
}
