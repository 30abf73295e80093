package sim

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/pkg/auth"
)

// Credentials are the bearer tokens the simulator presents when the mesh
// authenticates its routes: each simulated engine its own engine token
// (lookups, its gpuworkers' KV memory and data plane), and the operator
// token for the admin reads of the run's checks (trackers, dead letters,
// worker pools).
type Credentials struct {
	// Engine returns engine id's token; nil sends none.
	Engine func(engineID string) (string, error)
	// Operator is the operator token (KVMESH_ADMIN_TOKEN); empty sends
	// none.
	Operator string
}

// engineTokenTTL is how long a token the simulator mints for an engine
// lives (it mints a new one before that).
const engineTokenTTL = time.Hour

// MintEngineTokens returns a Credentials.Engine that signs each engine's
// token with the deployment's auth key, serving every tenant: the
// simulator plays the whole fleet, as an operator holding the key does
// with `kvmesh token`.
func MintEngineTokens(k auth.Key) func(engineID string) (string, error) {
	var mu sync.Mutex
	sources := map[string]*auth.Minted{}
	return func(id string) (string, error) {
		mu.Lock()
		src, ok := sources[id]
		if !ok {
			src = &auth.Minted{Key: k, Kind: auth.KindEngine, Subject: id, Tenants: []string{auth.AnyTenant}, TTL: engineTokenTTL}
			sources[id] = src
		}
		mu.Unlock()
		return src.Token(context.Background())
	}
}

type engineCtxKey struct{}

// withEngine marks ctx as engine id's: requests made with it carry that
// engine's token.
func withEngine(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, engineCtxKey{}, id)
}

// Token is the token of a request made with ctx (auth.TokenSource): the
// engine token of the engine ctx names (withEngine), else the operator
// token; "" when there is none.
func (c *Credentials) Token(ctx context.Context) (string, error) {
	if id, ok := ctx.Value(engineCtxKey{}).(string); ok && c.Engine != nil {
		return c.Engine(id)
	}
	return c.Operator, nil
}

// withCredentials returns hc sending c's tokens (hc itself when c is nil).
func withCredentials(hc *http.Client, c *Credentials) *http.Client {
	if c == nil {
		return hc
	}
	out := *hc
	out.Transport = auth.Transport(hc.Transport, c)
	return &out
}
