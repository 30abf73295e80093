package sending

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/singleflight"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

// Putter asks one engine rank's gpuworker to put pool blocks into the store
// pool; *dataplane.Client satisfies it.
type Putter interface {
	// Put stores the listed blocks and answers per item, in order, with the
	// framed bytes stored; err is a whole-request failure.
	Put(ctx context.Context, items []dataplane.PutItem) ([]dataplane.PutResult, int64, error)
}

// Workers finds the data planes of an engine's ranks.
type Workers interface {
	// Engine returns the putter of every live rank of engineID. No live
	// worker is a registry.ErrNoWorker error.
	Engine(ctx context.Context, engineID string) (map[kvcore.Rank]Putter, error)
	// Forget drops what is cached about engineID, after a failure.
	Forget(engineID string)
}

// DefaultRegistryCacheTTL is how long Registry reuses an engine's lookup.
const DefaultRegistryCacheTTL = time.Second

// Registry is Workers over the worker registry in PostgreSQL
// (registry.Find), with a short cache per engine and one HTTP client per
// worker address.
type Registry struct {
	pool   *pgxpool.Pool
	maxAge time.Duration
	ttl    time.Duration
	hc     *http.Client

	flight  singleflight.Group
	mu      sync.Mutex
	engines map[string]cachedEngine
	clients map[string]*dataplane.Client
}

type cachedEngine struct {
	putters map[kvcore.Rank]Putter
	at      time.Time
}

// NewRegistry returns a registry that treats workers whose heartbeat is
// older than maxAge as gone. hc carries every data-plane request; nil
// takes dataplane.DefaultHTTPClient.
func NewRegistry(pool *pgxpool.Pool, maxAge time.Duration, hc *http.Client) *Registry {
	if hc == nil {
		hc = dataplane.DefaultHTTPClient()
	}
	return &Registry{pool: pool, maxAge: maxAge, ttl: DefaultRegistryCacheTTL, hc: hc,
		engines: map[string]cachedEngine{}, clients: map[string]*dataplane.Client{}}
}

// Engine implements Workers. Concurrent look-ups of one engine (the
// ranks of one task, put at once) share one registry query.
func (r *Registry) Engine(ctx context.Context, engineID string) (map[kvcore.Rank]Putter, error) {
	r.mu.Lock()
	c, ok := r.engines[engineID]
	r.mu.Unlock()
	if ok && time.Since(c.at) < r.ttl {
		return c.putters, nil
	}
	v, err, _ := r.flight.Do(engineID, func() (any, error) { return r.find(ctx, engineID) })
	if err != nil {
		return nil, err
	}
	putters, _ := v.(map[kvcore.Rank]Putter) // find's only result type
	return putters, nil
}

// find reads the engine's live workers from the registry and caches them.
func (r *Registry) find(ctx context.Context, engineID string) (map[kvcore.Rank]Putter, error) {
	ws, err := registry.Find(ctx, r.pool, engineID, r.maxAge)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	putters := make(map[kvcore.Rank]Putter, len(ws))
	for _, w := range ws {
		cl, ok := r.clients[w.Addr]
		if !ok {
			cl = dataplane.NewClient(w.Addr, r.hc)
			r.clients[w.Addr] = cl
		}
		putters[w.Rank] = cl
	}
	r.engines[engineID] = cachedEngine{putters: putters, at: time.Now()}
	return putters, nil
}

// Close releases the idle connections to the workers.
func (r *Registry) Close() { r.hc.CloseIdleConnections() }

// Forget implements Workers.
func (r *Registry) Forget(engineID string) {
	r.mu.Lock()
	delete(r.engines, engineID)
	r.mu.Unlock()
}
