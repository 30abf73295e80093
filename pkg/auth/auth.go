// Package auth is kvmesh's credentials: who may call which route. There are
// three kinds of credential, each a bearer token:
//
//   - operator: the deployment's admin token (KVMESH_ADMIN_TOKEN), for the
//     admin routes (inspect and repair);
//   - engine: a signed token naming one engine and the tenants it serves,
//     for the routes an inference engine calls (lookup, its gpuworkers'
//     KV memory and data plane). An engine's token reaches only its own
//     engine's pool and tasks, and only its tenants' keys;
//   - service: a signed token naming a kvmesh service, for the calls
//     services make to each other (the sender's puts, the pd reads between
//     gpuworkers). Services mint their own from the shared key.
//
// Engine and service tokens are JSON Web Tokens signed with HMAC-SHA256
// under the deployment's auth key (KVMESH_AUTH_KEY, at least 32 bytes),
// with an expiry; `kvmesh token` mints engine tokens for operators.
// Verification pins the algorithm, requires the expiry and the issuer,
// and compares the operator token in constant time. Tokens are never
// logged.
package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/golang-jwt/jwt/v5"
)

// Kind is a kind of credential.
type Kind string

// The credential kinds.
const (
	// KindOperator is the admin token's kind.
	KindOperator Kind = "operator"
	// KindEngine is an inference engine's.
	KindEngine Kind = "engine"
	// KindService is a kvmesh service's.
	KindService Kind = "service"
)

// Issuer is the iss claim of every token kvmesh mints.
const Issuer = "kvmesh"

// MinKeyBytes is the shortest auth key accepted.
const MinKeyBytes = 32

// AnyTenant in an engine token's tenants lets it serve every tenant.
const AnyTenant = "*"

// Errors of this package. A refused credential's error wraps
// ErrUnauthenticated (absent, malformed, expired, badly signed: 401) or
// ErrForbidden (valid, but not for this route or resource: 403).
var (
	// ErrUnauthenticated means no valid credential was presented.
	ErrUnauthenticated = errors.New("auth: not authenticated")
	// ErrForbidden means the credential does not reach the resource.
	ErrForbidden = errors.New("auth: forbidden")
	// ErrShortKey means an auth key shorter than MinKeyBytes.
	ErrShortKey = errors.New("auth: the auth key is shorter than 32 bytes")
	// ErrBadClaims means a token to mint has an unknown kind, an empty
	// or malformed subject, or a bad tenant.
	ErrBadClaims = errors.New("auth: bad token claims")
)

// subjectPattern is what an engine id or service name may be in a token.
var subjectPattern = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,128}$`)

// claims is the JWT body of engine and service tokens.
type claims struct {
	Kind    Kind     `json:"kvmesh_kind"`
	Tenants []string `json:"tenants,omitempty"`
	jwt.RegisteredClaims
}

// Principal is who a verified credential names.
type Principal struct {
	// Kind is the credential's kind.
	Kind Kind
	// Subject is the engine id (engine), the service name (service) or
	// "operator".
	Subject string
	// Tenants are the tenants an engine serves; AnyTenant allows all.
	// An engine without tenants serves only the default (empty) tenant.
	Tenants []string
	// ExpiresAt is when the token stops being valid (zero for the
	// operator token).
	ExpiresAt time.Time
}

// AllowsTenant reports whether the principal may act for tenant t. Only
// engines are bound to tenants; operators and services reach every one.
func (p *Principal) AllowsTenant(t string) bool {
	if p.Kind != KindEngine {
		return true
	}
	if t == "" {
		return len(p.Tenants) == 0 || slices.Contains(p.Tenants, AnyTenant) || slices.Contains(p.Tenants, "")
	}
	return slices.Contains(p.Tenants, AnyTenant) || slices.Contains(p.Tenants, t)
}

// Key is a deployment's auth key: it signs and verifies engine and
// service tokens.
type Key struct{ secret []byte }

// NewKey checks and wraps an auth key.
func NewKey(secret string) (Key, error) {
	if len(secret) < MinKeyBytes {
		return Key{}, ErrShortKey
	}
	return Key{secret: []byte(secret)}, nil
}

// Mint signs a token of kind for subject (an engine id or a service name),
// serving tenants (engines only), valid for ttl.
func (k Key) Mint(kind Kind, subject string, tenants []string, ttl time.Duration) (string, error) {
	return k.mintAt(kind, subject, tenants, ttl, time.Now())
}

func (k Key) mintAt(kind Kind, subject string, tenants []string, ttl time.Duration, now time.Time) (string, error) {
	if kind != KindEngine && kind != KindService {
		return "", fmt.Errorf("%w: kind %q (want engine or service)", ErrBadClaims, kind)
	}
	if !subjectPattern.MatchString(subject) {
		return "", fmt.Errorf("%w: subject %q", ErrBadClaims, subject)
	}
	if kind == KindService && len(tenants) > 0 {
		return "", fmt.Errorf("%w: a service token names no tenants", ErrBadClaims)
	}
	for _, t := range tenants {
		if t != AnyTenant && !tenantPattern.MatchString(t) {
			return "", fmt.Errorf("%w: tenant %q", ErrBadClaims, t)
		}
	}
	if ttl <= 0 {
		return "", fmt.Errorf("%w: ttl %v is not positive", ErrBadClaims, ttl)
	}
	c := claims{Kind: kind, Tenants: tenants, RegisteredClaims: jwt.RegisteredClaims{
		Issuer: Issuer, Subject: subject,
		IssuedAt: jwt.NewNumericDate(now), ExpiresAt: jwt.NewNumericDate(now.Add(ttl)),
	}}
	s, err := jwt.NewWithClaims(jwt.SigningMethodHS256, c).SignedString(k.secret)
	if err != nil {
		return "", fmt.Errorf("auth: sign: %w", err)
	}
	return s, nil
}

// tenantPattern is what a tenant may be in a token (the store keys'
// tenant segment accepts no more).
var tenantPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// Verifier checks bearer tokens: the operator token, and engine and
// service tokens signed with the key.
//
// A signed token it has verified is remembered, by its SHA-256, until the
// token's expiry, so a client that presents one token on every request (a
// service's minted token, an engine's) has its signature checked and its
// claims decoded once, not on every request: a data-plane read or put
// costs a map look-up. The answer is the same: what a verified token
// names cannot change before it expires (its claims are signed), the keys
// a Verifier accepts are fixed for its life, and a token is never taken
// from the memory at or past its expiry — it is verified again, which
// refuses it once the leeway is over. A token that failed is not
// remembered.
type Verifier struct {
	keys     jwt.VerificationKeySet // the key, then the ones being rotated out
	operator [sha256.Size]byte
	hasOp    bool
	now      func() time.Time

	mu       sync.Mutex
	verified map[[sha256.Size]byte]Principal
}

// maxVerified bounds how many verified tokens a Verifier remembers; past
// it the expired ones are dropped, and if none were, all of them.
const maxVerified = 4096

// NewVerifier returns a Verifier for key and the operator token (empty:
// no operator token is accepted). Tokens signed with one of previous (keys
// being rotated out) are accepted too.
func NewVerifier(key Key, operatorToken string, previous ...Key) *Verifier {
	v := &Verifier{now: time.Now}
	for _, k := range append([]Key{key}, previous...) {
		v.keys.Keys = append(v.keys.Keys, k.secret)
	}
	if operatorToken != "" {
		v.operator, v.hasOp = sha256.Sum256([]byte(operatorToken)), true
	}
	return v
}

// Verify returns the principal a bearer token names, or an error wrapping
// ErrUnauthenticated. The error says why without quoting the token.
func (v *Verifier) Verify(token string) (*Principal, error) {
	if token == "" {
		return nil, fmt.Errorf("%w: no bearer token", ErrUnauthenticated)
	}
	got := sha256.Sum256([]byte(token))
	if v.hasOp && subtle.ConstantTimeCompare(got[:], v.operator[:]) == 1 {
		return &Principal{Kind: KindOperator, Subject: string(KindOperator)}, nil
	}
	if p, ok := v.remembered(got); ok {
		return p, nil
	}
	if strings.Count(token, ".") != 2 {
		return nil, fmt.Errorf("%w: the token is neither the operator token nor a signed token", ErrUnauthenticated)
	}
	var c claims
	_, err := jwt.ParseWithClaims(token, &c, func(*jwt.Token) (any, error) { return v.keys, nil },
		jwt.WithValidMethods([]string{jwt.SigningMethodHS256.Alg()}), jwt.WithIssuer(Issuer),
		jwt.WithExpirationRequired(), jwt.WithIssuedAt(), jwt.WithTimeFunc(v.now), jwt.WithLeeway(5*time.Second))
	if err != nil {
		return nil, fmt.Errorf("%w: %s", ErrUnauthenticated, reason(err))
	}
	if (c.Kind != KindEngine && c.Kind != KindService) || !subjectPattern.MatchString(c.Subject) {
		return nil, fmt.Errorf("%w: the token's kind or subject is not valid", ErrUnauthenticated)
	}
	p := Principal{Kind: c.Kind, Subject: c.Subject, Tenants: c.Tenants, ExpiresAt: c.ExpiresAt.Time}
	v.remember(got, p)
	return &p, nil
}

// remembered returns the principal of a signed token verified before,
// when it has not expired yet (a copy: the caller may change it).
func (v *Verifier) remembered(sum [sha256.Size]byte) (*Principal, bool) {
	v.mu.Lock()
	p, ok := v.verified[sum]
	if ok && !v.now().Before(p.ExpiresAt) {
		delete(v.verified, sum)
		ok = false
	}
	v.mu.Unlock()
	if !ok {
		return nil, false
	}
	p.Tenants = slices.Clone(p.Tenants)
	return &p, true
}

// remember keeps the principal of a signed token just verified, until the
// token's expiry.
func (v *Verifier) remember(sum [sha256.Size]byte, p Principal) {
	p.Tenants = slices.Clone(p.Tenants)
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.verified == nil {
		v.verified = map[[sha256.Size]byte]Principal{}
	}
	if len(v.verified) >= maxVerified {
		now := v.now()
		for k, q := range v.verified {
			if !now.Before(q.ExpiresAt) {
				delete(v.verified, k)
			}
		}
		if len(v.verified) >= maxVerified {
			clear(v.verified)
		}
	}
	v.verified[sum] = p
}

// reason names why a signed token was refused, in a few words.
func reason(err error) string {
	switch {
	case errors.Is(err, jwt.ErrTokenExpired):
		return "the token has expired"
	case errors.Is(err, jwt.ErrTokenSignatureInvalid):
		return "the token's signature is not valid"
	case errors.Is(err, jwt.ErrTokenMalformed):
		return "the token is malformed"
	case errors.Is(err, jwt.ErrTokenInvalidIssuer):
		return "the token was not issued by kvmesh"
	case errors.Is(err, jwt.ErrTokenRequiredClaimMissing):
		return "the token has no expiry"
	case errors.Is(err, jwt.ErrTokenUsedBeforeIssued), errors.Is(err, jwt.ErrTokenNotValidYet):
		return "the token is not valid yet"
	case errors.Is(err, jwt.ErrTokenUnverifiable):
		return "the token's algorithm is not accepted"
	default:
		return "the token is not valid"
	}
}

type ctxKey struct{}

// NewContext returns ctx carrying p.
func NewContext(ctx context.Context, p *Principal) context.Context {
	return context.WithValue(ctx, ctxKey{}, p)
}

// FromContext returns the principal the server verified for this request,
// or nil when authentication is off.
func FromContext(ctx context.Context) *Principal {
	p, _ := ctx.Value(ctxKey{}).(*Principal)
	return p
}
