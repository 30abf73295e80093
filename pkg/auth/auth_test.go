package auth

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
)

const testSecret = "0123456789abcdef0123456789abcdef"

func testKey(t *testing.T, s string) Key {
	t.Helper()
	k, err := NewKey(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestVerify(t *testing.T) {
	k := testKey(t, testSecret)
	other := testKey(t, strings.Repeat("x", 32))
	v := NewVerifier(k, "op-token")
	now := time.Now()
	mint := func(k Key, kind Kind, sub string, tenants []string, ttl time.Duration, at time.Time) string {
		s, err := k.mintAt(kind, sub, tenants, ttl, at)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	engine := mint(k, KindEngine, "decode-0", []string{"acme"}, time.Hour, now)
	// A token whose header says alg none, with the engine token's body.
	parts := strings.Split(engine, ".")
	none := base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","typ":"JWT"}`)) + "." + parts[1] + "."
	for _, tc := range []struct {
		name, token string
		kind        Kind
		sub         string
		why         string
	}{
		{name: "operator", token: "op-token", kind: KindOperator, sub: "operator"},
		{name: "engine", token: engine, kind: KindEngine, sub: "decode-0"},
		{name: "service", token: mint(k, KindService, "sender", nil, time.Minute, now), kind: KindService, sub: "sender"},
		{name: "empty", token: "", why: "no bearer token"},
		{name: "wrong operator token", token: "op-tokem", why: "neither"},
		{name: "other key", token: mint(other, KindEngine, "decode-0", nil, time.Hour, now), why: "signature"},
		{name: "expired", token: mint(k, KindEngine, "decode-0", nil, time.Minute, now.Add(-time.Hour)), why: "expired"},
		{name: "malformed", token: "a.b.c", why: "malformed"},
		{name: "alg none", token: none, why: "not valid"},
		{name: "tampered body", token: parts[0] + "." + parts[1] + "x." + parts[2], why: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := v.Verify(tc.token)
			if tc.kind == "" {
				if !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), tc.why) {
					t.Fatalf("Verify = %v, %v; want ErrUnauthenticated saying %q", p, err, tc.why)
				}
				if tc.token != "" && strings.Contains(err.Error(), tc.token) {
					t.Fatalf("the error quotes the token: %v", err)
				}
				return
			}
			if err != nil || p.Kind != tc.kind || p.Subject != tc.sub {
				t.Fatalf("Verify = %+v, %v; want %s %s", p, err, tc.kind, tc.sub)
			}
		})
	}
	if v2 := NewVerifier(k, ""); v2 != nil {
		if _, err := v2.Verify(""); !errors.Is(err, ErrUnauthenticated) {
			t.Fatalf("no operator token configured: empty token gave %v", err)
		}
	}
}

func TestMintRefusesBadClaims(t *testing.T) {
	k := testKey(t, testSecret)
	for name, f := range map[string]func() error{
		"operator kind":   func() error { _, err := k.Mint(KindOperator, "x", nil, time.Hour); return err },
		"empty subject":   func() error { _, err := k.Mint(KindEngine, "", nil, time.Hour); return err },
		"space subject":   func() error { _, err := k.Mint(KindEngine, "a b", nil, time.Hour); return err },
		"service tenants": func() error { _, err := k.Mint(KindService, "sender", []string{"t"}, time.Hour); return err },
		"bad tenant":      func() error { _, err := k.Mint(KindEngine, "e", []string{"a@b"}, time.Hour); return err },
		"no ttl":          func() error { _, err := k.Mint(KindEngine, "e", nil, 0); return err },
	} {
		if err := f(); !errors.Is(err, ErrBadClaims) {
			t.Errorf("%s: %v, want ErrBadClaims", name, err)
		}
	}
	if _, err := NewKey("short"); !errors.Is(err, ErrShortKey) {
		t.Errorf("short key: %v", err)
	}
}

func TestAllowsTenant(t *testing.T) {
	for _, tc := range []struct {
		p      Principal
		tenant string
		want   bool
	}{
		{Principal{Kind: KindEngine}, "", true},
		{Principal{Kind: KindEngine}, "acme", false},
		{Principal{Kind: KindEngine, Tenants: []string{"acme"}}, "acme", true},
		{Principal{Kind: KindEngine, Tenants: []string{"acme"}}, "globex", false},
		{Principal{Kind: KindEngine, Tenants: []string{"acme"}}, "", false},
		{Principal{Kind: KindEngine, Tenants: []string{AnyTenant}}, "globex", true},
		{Principal{Kind: KindService}, "globex", true},
		{Principal{Kind: KindOperator}, "globex", true},
	} {
		if got := tc.p.AllowsTenant(tc.tenant); got != tc.want {
			t.Errorf("%+v AllowsTenant(%q) = %v, want %v", tc.p, tc.tenant, got, tc.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		c  Config
		ok bool
	}{
		{Config{Mode: ModeOff}, true},
		{Config{Mode: ModeRequired, Key: testSecret}, true},
		{Config{Mode: ModeRequired}, false},
		{Config{Mode: ModeRequired, Key: "short"}, false},
		{Config{Mode: "maybe", Key: testSecret}, false},
	} {
		if err := tc.c.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v: Validate = %v, want ok=%v", tc.c.Mode, err, tc.ok)
		}
	}
}

func TestTransportSetsBearer(t *testing.T) {
	k := testKey(t, testSecret)
	src := ServiceTokens(k, "sender")
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.Header.Get("Authorization"))
	}))
	defer srv.Close()
	c := &http.Client{Transport: Transport(nil, src)}
	for range 2 {
		resp, err := c.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
	}
	if len(got) != 2 || got[0] != got[1] || !strings.HasPrefix(got[0], "Bearer ") {
		t.Fatalf("Authorization headers %q: want one cached bearer token twice", got)
	}
	p, err := NewVerifier(k, "").Verify(strings.TrimPrefix(got[0], "Bearer "))
	if err != nil || p.Kind != KindService || p.Subject != "sender" {
		t.Fatalf("the sent token verifies as %+v, %v", p, err)
	}
}

// TestKeyRotation: with the old key as the previous one, tokens either key
// signed verify; a third key's do not; a short previous key is refused.
func TestKeyRotation(t *testing.T) {
	oldKey, newKey, other := testKey(t, strings.Repeat("o", 32)), testKey(t, strings.Repeat("n", 32)), testKey(t, strings.Repeat("x", 32))
	v, err := Config{Mode: ModeRequired, Key: strings.Repeat("n", 32), PreviousKey: strings.Repeat("o", 32)}.Verifier("")
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		k  Key
		ok bool
	}{"new key": {newKey, true}, "previous key": {oldKey, true}, "another key": {other, false}} {
		tok, err := tc.k.Mint(KindEngine, "e", nil, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Verify(tok); (err == nil) != tc.ok {
			t.Errorf("%s: Verify = %v, want ok=%v", name, err, tc.ok)
		}
	}
	if err := (Config{Mode: ModeRequired, Key: testSecret, PreviousKey: "short"}).Validate(); err == nil || !strings.Contains(err.Error(), "KVMESH_AUTH_PREVIOUS_KEY") {
		t.Fatalf("short previous key: %v, want an error naming KVMESH_AUTH_PREVIOUS_KEY", err)
	}
}

// TestVerifyRemembersUntilExpiry: a signed token verified once is answered
// from memory (with the keys gone, it still verifies; a new token does
// not), each answer a copy; at its expiry it is verified again, so the
// leeway and the refusal after it are what they were; a refused token is
// not remembered; the memory stays bounded.
func TestVerifyRemembersUntilExpiry(t *testing.T) {
	k := testKey(t, testSecret)
	v := NewVerifier(k, "op-token")
	now := time.Now()
	v.now = func() time.Time { return now }
	tok, err := k.mintAt(KindEngine, "decode-0", []string{"acme"}, time.Minute, now)
	if err != nil {
		t.Fatal(err)
	}
	p, err := v.Verify(tok)
	if err != nil || p.Subject != "decode-0" {
		t.Fatalf("Verify = %+v, %v", p, err)
	}
	p.Tenants[0], p.Subject = "evil", "evil"
	keys := v.keys
	v.keys = jwtKeysNone()
	q, err := v.Verify(tok)
	if err != nil || q.Subject != "decode-0" || q.Tenants[0] != "acme" || q.Kind != KindEngine {
		t.Fatalf("remembered token: %+v, %v; want decode-0 serving acme, unchanged by the caller", q, err)
	}
	other, _ := k.mintAt(KindEngine, "decode-1", nil, time.Minute, now)
	if _, err := v.Verify(other); !errors.Is(err, ErrUnauthenticated) {
		t.Fatalf("a token never verified was not checked against the keys: %v", err)
	}
	v.keys = keys

	bad, _ := testKey(t, strings.Repeat("x", 32)).mintAt(KindEngine, "decode-0", nil, time.Minute, now)
	if _, err := v.Verify(bad); err == nil {
		t.Fatal("a token of another key verified")
	}
	if len(v.verified) != 1 {
		t.Fatalf("%d tokens remembered, want 1 (a refused one is not)", len(v.verified))
	}

	now = now.Add(time.Minute + 2*time.Second) // past the expiry, inside the leeway
	if _, err := v.Verify(tok); err != nil {
		t.Fatalf("inside the leeway: %v", err)
	}
	now = now.Add(5 * time.Second)
	if _, err := v.Verify(tok); !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("past the leeway: %v, want expired", err)
	}

	now = time.Now()
	for i := range maxVerified + 10 {
		s, err := k.mintAt(KindService, fmt.Sprintf("svc-%d", i), nil, time.Hour, now)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Verify(s); err != nil {
			t.Fatal(err)
		}
		if len(v.verified) > maxVerified {
			t.Fatalf("%d tokens remembered, more than %d", len(v.verified), maxVerified)
		}
	}
}

// jwtKeysNone is a key set that verifies nothing.
func jwtKeysNone() jwt.VerificationKeySet {
	return jwt.VerificationKeySet{Keys: []jwt.VerificationKey{[]byte(strings.Repeat("z", 32))}}
}
