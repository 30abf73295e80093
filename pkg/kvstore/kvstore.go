// Package kvstore is the store pool: it holds KV-cache block bytes keyed by
// Mooncake-layout strings, behind a small batched interface with per-key
// results.
//
// Two implementations are provided: NewMemory, an in-process store for unit
// tests and single-process demos, and NewRedis, backed by Redis or Valkey
// through go-redis, a single server or a Redis Cluster. Both pass the same contract suite (package kvstoretest).
// Cross-cutting concerns such as metrics are added by wrapping a Store.
package kvstore

import (
	"context"
	"errors"
)

// Store is a batched key-value store for KV-cache blocks.
//
// Every batch method answers per key, in the order of its input, and returns
// a separate whole-batch error. When the whole-batch error is non-nil the
// per-key results are nil and the batch must be treated as failed as a whole
// (a failed Put or Remove may have been partly applied; both are idempotent
// enough to retry). An empty batch succeeds with empty results and no I/O.
//
// Values are written once: keys are content-addressed (a key names its
// chunk), so Put never replaces a present key; it reports ErrExists for it
// instead, and of two writers racing on one key exactly one stores it.
// Duplicate keys within a batch are handled in input order: the first Put of
// a key stores it and a later one reports ErrExists, and a second Remove of
// the same key reports ErrNotFound.
// Implementations are safe for concurrent use and never alias callers'
// buffers: Put copies or sends the values before returning, and Get returns
// slices the caller owns.
type Store interface {
	// Exists reports, for each key, whether it is present, in one round-trip
	// for ordinary batch sizes.
	Exists(ctx context.Context, keys []string) ([]bool, error)
	// Put stores each item whose key is not present. The per-key error is
	// nil when the item was stored; it wraps ErrExists when the key was
	// already present (nothing written), or ErrNoSpace, ErrTooLarge or
	// another cause.
	Put(ctx context.Context, items []Item) ([]error, error)
	// Get returns each key's value, or a per-key error wrapping ErrNotFound
	// (the value is then nil). A present empty value is a non-nil empty slice.
	Get(ctx context.Context, keys []string) ([][]byte, []error, error)
	// Remove deletes each key. The per-key error wraps ErrNotFound when the
	// key was not present.
	Remove(ctx context.Context, keys []string) ([]error, error)
	// Ping checks that the store is reachable.
	Ping(ctx context.Context) error
	// Close releases the store's resources. Later calls return ErrClosed;
	// closing twice is not an error.
	Close() error
}

// Item is one key and its value for Put.
type Item struct {
	// Key is the store key, in Mooncake's layout.
	Key string
	// Value is the block bytes; nil is stored as an empty value.
	Value []byte
}

// Sentinel errors. Implementations wrap them with context; test with errors.Is.
var (
	// ErrNotFound reports that a key is not present.
	ErrNotFound = errors.New("kvstore: key not found")
	// ErrExists reports a Put of a key that was already present: nothing
	// was written (values are written once).
	ErrExists = errors.New("kvstore: key already present")
	// ErrNoSpace reports that the store is full and does not evict
	// (Redis "OOM command not allowed", or a Memory store without eviction).
	ErrNoSpace = errors.New("kvstore: store has no space")
	// ErrTooLarge reports a value over the store's configured maximum size.
	ErrTooLarge = errors.New("kvstore: value too large")
	// ErrUnavailable reports a connection-level failure; it wraps the cause.
	ErrUnavailable = errors.New("kvstore: store unavailable")
	// ErrClosed reports use of a store after Close.
	ErrClosed = errors.New("kvstore: store closed")

	// The store URL's parsing errors follow; each is wrapped with the part at fault.

	// errNoSeeds reports a cluster URL without any host.
	errNoSeeds = errors.New("cluster URL names no host")
	// errBadSeed reports a seed node that is not host[:port] with a port in 1..65535.
	errBadSeed = errors.New("seed node is not host:port")
	// errClusterDB reports a database other than 0 in a cluster URL: a
	// Redis Cluster has database 0 only.
	errClusterDB = errors.New("a Redis Cluster has database 0 only")
	// errNotCluster reports a single server's URL where a cluster's is needed.
	errNotCluster = errors.New("URL names a single server, not a cluster (want redis+cluster://host:port,host:port,...)")
	// errClusterURL reports a cluster URL where a single server's is needed.
	errClusterURL = errors.New("URL names a Redis Cluster, not a single server (use RedisClusterOptions)")
	// errTLSPlain reports TLS settings (RedisTLS) given with a plain
	// redis:// or redis+cluster:// URL.
	errTLSPlain = errors.New("TLS files or a server name are set but the URL is not TLS (use rediss:// or rediss+cluster://)")
	// errPlainToTLS explains a plain connection the server closed at once,
	// which is how a TLS-only port answers one.
	errPlainToTLS = errors.New("the server closed the plain connection: if it speaks TLS, use rediss:// or rediss+cluster://")
)

// IsTransient reports whether err may go away if the same call is retried
// later: connection-level failures (ErrUnavailable) and deadlines
// (context.DeadlineExceeded). ErrNoSpace is not transient in this sense: a
// full store calls for pressure handling, not a prompt retry of the same put.
func IsTransient(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, context.DeadlineExceeded)
}

// ValueVisitor is implemented by stores that can hand each value of a Get
// to the caller in a buffer of their own, reused for the next value,
// instead of a fresh slice per value: a loader that verifies a value and
// copies it into its destination at once saves the allocation, the zeroing
// and the page faults of a fresh slice for every block.
type ValueVisitor interface {
	// GetEach gets keys like Get, but calls use(i, value) for each present
	// key in input order, with value valid only until use returns; use's
	// error becomes that key's error. The per-key error of an absent key
	// wraps ErrNotFound (use is not called). A whole-batch error means the
	// per-key results are nil; use may have been called for some keys.
	GetEach(ctx context.Context, keys []string, use func(i int, value []byte) error) ([]error, error)
}
