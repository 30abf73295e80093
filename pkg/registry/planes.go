package registry

import (
	"context"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// DefaultPlanesTTL is how long Planes reuses an engine's registry read.
const DefaultPlanesTTL = time.Second

// Planes finds the data planes of an engine's live ranks: the sender's put
// targets, a gpuworker's pd load sources. An engine's live workers are
// read once (find, registry.Find with the caller's stale-after) and reused
// for the TTL by every caller; concurrent look-ups of one engine share one
// read; each address keeps one client (dial). Forget drops an engine after
// a failure, so the next look-up reads again; a failed read is not cached.
//
// What it reuses is only where a rank listens: which bytes a block holds is
// still proven by the worker on every call (the hash each block must
// hold), so a stale address can fail a call closed, never serve or store a
// wrong block.
type Planes[C any] struct {
	find func(ctx context.Context, engineID string) ([]Worker, error)
	dial func(addr string) C
	ttl  time.Duration
	now  func() time.Time

	flight  singleflight.Group
	mu      sync.Mutex
	engines map[string]cachedPlanes[C]
	clients map[string]C
}

// cachedPlanes is one engine's cached registry answer.
type cachedPlanes[C any] struct {
	ranks map[kvcore.Rank]C
	at    time.Time
}

// NewPlanes returns the planes read with find, each address's client made
// once by dial, reused for ttl.
func NewPlanes[C any](find func(ctx context.Context, engineID string) ([]Worker, error), dial func(addr string) C, ttl time.Duration) *Planes[C] {
	return &Planes[C]{find: find, dial: dial, ttl: ttl, now: time.Now,
		engines: map[string]cachedPlanes[C]{}, clients: map[string]C{}}
}

// Engine returns the client of every live rank of engineID, from the cache
// when it is younger than the TTL. No live worker is an ErrNoWorker error.
func (p *Planes[C]) Engine(ctx context.Context, engineID string) (map[kvcore.Rank]C, error) {
	p.mu.Lock()
	e, ok := p.engines[engineID]
	p.mu.Unlock()
	if ok && p.now().Sub(e.at) < p.ttl {
		return e.ranks, nil
	}
	v, err, _ := p.flight.Do(engineID, func() (any, error) { return p.read(ctx, engineID) })
	if err != nil {
		return nil, err
	}
	ranks, _ := v.(map[kvcore.Rank]C) // read's only result type
	return ranks, nil
}

// Rank returns the client of engineID's rank r, or an error wrapping
// ErrNoWorker when the registry holds no live worker of it.
func (p *Planes[C]) Rank(ctx context.Context, engineID string, r kvcore.Rank) (C, error) {
	var zero C
	ranks, err := p.Engine(ctx, engineID)
	if err != nil {
		return zero, err
	}
	c, ok := ranks[r]
	if !ok {
		return zero, fmt.Errorf("engine %q rank %+v: %w", engineID, r, ErrNoWorker)
	}
	return c, nil
}

// Forget drops what is cached about engineID, after a failure.
func (p *Planes[C]) Forget(engineID string) {
	p.mu.Lock()
	delete(p.engines, engineID)
	p.mu.Unlock()
}

// read reads engineID's live workers and caches them.
func (p *Planes[C]) read(ctx context.Context, engineID string) (map[kvcore.Rank]C, error) {
	ws, err := p.find(ctx, engineID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	ranks := make(map[kvcore.Rank]C, len(ws))
	for _, w := range ws {
		c, ok := p.clients[w.Addr]
		if !ok {
			c = p.dial(w.Addr)
			p.clients[w.Addr] = c
		}
		ranks[w.Rank] = c
	}
	p.engines[engineID] = cachedPlanes[C]{ranks: ranks, at: p.now()}
	return ranks, nil
}
