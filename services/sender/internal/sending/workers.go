package sending

import (
	"context"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
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

// Registry is Workers over the worker registry in PostgreSQL
// (registry.Find) through registry.Planes: one read per engine per
// registry.DefaultPlanesTTL, one HTTP client per worker address.
type Registry struct {
	*registry.Planes[Putter]
	hc *http.Client
}

// NewRegistry returns a registry that treats workers whose heartbeat is
// older than maxAge as gone. hc carries every data-plane request; nil
// takes dataplane.DefaultHTTPClient.
func NewRegistry(pool *pgxpool.Pool, maxAge time.Duration, hc *http.Client) *Registry {
	if hc == nil {
		hc = dataplane.DefaultHTTPClient()
	}
	find := func(ctx context.Context, engineID string) ([]registry.Worker, error) {
		return registry.Find(ctx, pool, engineID, maxAge)
	}
	dial := func(addr string) Putter { return dataplane.NewClient(addr, hc) }
	return &Registry{Planes: registry.NewPlanes(find, dial, registry.DefaultPlanesTTL), hc: hc}
}

// Close releases the idle connections to the workers.
func (r *Registry) Close() { r.hc.CloseIdleConnections() }
