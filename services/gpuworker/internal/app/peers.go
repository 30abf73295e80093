package app

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

// peerClient is the HTTP client of this worker's reads from other
// gpuworkers (pd loads): the data plane's transport with the service's
// HTTPS client settings and, when authentication is required, a service
// token of its own.
func (a *App) peerClient() (*http.Client, error) {
	rt, err := a.cfg.ServiceTransport("gpuworker", dataplane.DefaultTransport())
	if err != nil {
		return nil, err
	}
	return dataplane.HTTPClient(rt), nil
}

// peerCacheTTL is how long peers reuses an engine's registry lookup: the
// sender's (sending.DefaultRegistryCacheTTL).
const peerCacheTTL = time.Second

// peerFinder reads an engine's live workers from the registry
// (registry.Find with the worker's stale-after).
type peerFinder func(ctx context.Context, engineID string) ([]registry.Worker, error)

// peers finds the data planes of other engines' ranks, the pd load sources,
// as the sender finds its put targets: the live workers of an engine are
// read from the registry once and reused for peerCacheTTL by every load
// (concurrent look-ups of one engine share one query), and each address
// keeps one client. A failed read drops the engine's entry (forget), so
// the next load reads the registry again.
//
// Without it every rank read the registry for every pd load: with TP8 eight
// queries (transactions) per request, each a full read of the engine's
// rows. What it reuses is only where a rank listens: which bytes a block
// holds is still proven by the source worker on every read (the hash each
// block must hold), so a stale address can fail a load closed, never serve
// a wrong block.
type peers struct {
	find peerFinder
	hc   *http.Client
	ttl  time.Duration
	now  func() time.Time

	flight  singleflight.Group
	mu      sync.Mutex
	engines map[string]peerEngine
	clients map[string]*dataplane.Client
}

// peerEngine is one engine's cached registry answer.
type peerEngine struct {
	ranks map[kvcore.Rank]*dataplane.Client
	at    time.Time
}

func newPeers(find peerFinder, hc *http.Client, ttl time.Duration) *peers {
	return &peers{find: find, hc: hc, ttl: ttl, now: time.Now,
		engines: map[string]peerEngine{}, clients: map[string]*dataplane.Client{}}
}

// rank returns the data-plane client of engineID's rank r, or an error
// wrapping registry.ErrNoWorker when the registry holds no live worker of
// it (load.RemoteFinder).
func (p *peers) rank(ctx context.Context, engineID string, r kvcore.Rank) (*dataplane.Client, error) {
	ranks, err := p.engine(ctx, engineID)
	if err != nil {
		return nil, err
	}
	c, ok := ranks[r]
	if !ok {
		return nil, fmt.Errorf("engine %q rank %+v: %w", engineID, r, registry.ErrNoWorker)
	}
	return c, nil
}

// engine returns the clients of engineID's live ranks, from the cache when
// it is younger than the TTL.
func (p *peers) engine(ctx context.Context, engineID string) (map[kvcore.Rank]*dataplane.Client, error) {
	p.mu.Lock()
	e, ok := p.engines[engineID]
	p.mu.Unlock()
	if ok && p.now().Sub(e.at) < p.ttl {
		return e.ranks, nil
	}
	v, err, _ := p.flight.Do(engineID, func() (any, error) { return p.load(ctx, engineID) })
	if err != nil {
		return nil, err
	}
	ranks, _ := v.(map[kvcore.Rank]*dataplane.Client) // load's only result type
	return ranks, nil
}

// load reads engineID's live workers and caches them.
func (p *peers) load(ctx context.Context, engineID string) (map[kvcore.Rank]*dataplane.Client, error) {
	ws, err := p.find(ctx, engineID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	ranks := make(map[kvcore.Rank]*dataplane.Client, len(ws))
	for _, w := range ws {
		c, ok := p.clients[w.Addr]
		if !ok {
			c = dataplane.NewClient(w.Addr, p.hc)
			p.clients[w.Addr] = c
		}
		ranks[w.Rank] = c
	}
	p.engines[engineID] = peerEngine{ranks: ranks, at: p.now()}
	return ranks, nil
}

// forget drops what is cached about engineID, after a failed read.
func (p *peers) forget(engineID string) {
	p.mu.Lock()
	delete(p.engines, engineID)
	p.mu.Unlock()
}
