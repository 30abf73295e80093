package auth

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// TokenSource gives the bearer token of an outgoing request.
type TokenSource interface {
	// Token returns the token to send now with a request made with ctx
	// (a source may choose it by what ctx carries); "" sends none.
	Token(ctx context.Context) (string, error)
}

// Static is a TokenSource of one fixed token (an engine token given to a
// client, or the operator token).
type Static string

// Token returns the token.
func (s Static) Token(context.Context) (string, error) { return string(s), nil }

// Minted is a TokenSource that signs its own tokens of one kind and
// subject with a key, each valid for TTL, and signs a new one when less
// than a third of the last one's life is left. It is safe for concurrent
// use.
type Minted struct {
	Key     Key
	Kind    Kind
	Subject string
	Tenants []string
	TTL     time.Duration

	mu      sync.Mutex
	token   string
	renewAt time.Time
}

// DefaultServiceTTL is how long a service token a service mints for its own
// calls lives.
const DefaultServiceTTL = 15 * time.Minute

// ServiceTokens is a Minted source of service tokens for the named service.
func ServiceTokens(k Key, service string) *Minted {
	return &Minted{Key: k, Kind: KindService, Subject: service, TTL: DefaultServiceTTL}
}

// Token returns a valid token, signing a new one when due.
func (m *Minted) Token(context.Context) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	if m.token != "" && now.Before(m.renewAt) {
		return m.token, nil
	}
	t, err := m.Key.mintAt(m.Kind, m.Subject, m.Tenants, m.TTL, now)
	if err != nil {
		return "", err
	}
	m.token, m.renewAt = t, now.Add(m.TTL*2/3)
	return t, nil
}

// Transport returns a RoundTripper that sets "Authorization: Bearer" from
// src on every request it sends through base (http.DefaultTransport when
// nil). A nil src, or an empty token, sends the request as it is. A
// request that already carries an Authorization header keeps it.
func Transport(base http.RoundTripper, src TokenSource) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	if src == nil {
		return base
	}
	return &bearer{base: base, src: src}
}

type bearer struct {
	base http.RoundTripper
	src  TokenSource
}

func (b *bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Header.Get("Authorization") != "" {
		return b.base.RoundTrip(r)
	}
	t, err := b.src.Token(r.Context())
	if err != nil {
		if r.Body != nil {
			_ = r.Body.Close()
		}
		return nil, err
	}
	if t == "" {
		return b.base.RoundTrip(r)
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+t)
	return b.base.RoundTrip(r)
}

// CloseIdleConnections closes the base transport's idle connections.
func (b *bearer) CloseIdleConnections() {
	if c, ok := b.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}
