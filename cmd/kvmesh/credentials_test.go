package main

import (
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/auth"
)

const tokenTestKey = "cli-token-test-key-0123456789abcdef"

// TestTokenMintsVerifiableEngineTokens: `kvmesh token` prints a token that
// the services' verifier accepts as the engine and tenants asked for, and
// refuses bad requests with a usage error.
func TestTokenMintsVerifiableEngineTokens(t *testing.T) {
	t.Setenv("KVMESH_AUTH", "required")
	t.Setenv("KVMESH_AUTH_KEY", tokenTestKey)
	r := runCLI(t, "token", "--engine", "decode-7", "--tenant", "acme, globex", "--ttl", "1h").ok(t)
	key, err := auth.NewKey(tokenTestKey)
	if err != nil {
		t.Fatal(err)
	}
	p, err := auth.NewVerifier(key, "").Verify(strings.TrimSpace(r.stdout))
	if err != nil {
		t.Fatal(err)
	}
	if p.Kind != auth.KindEngine || p.Subject != "decode-7" || !p.AllowsTenant("globex") || p.AllowsTenant("initech") {
		t.Fatalf("minted %+v, want engine decode-7 serving acme and globex", p)
	}
	svc := runCLI(t, "token", "--service", "sender").ok(t)
	if p, err := auth.NewVerifier(key, "").Verify(strings.TrimSpace(svc.stdout)); err != nil || p.Kind != auth.KindService {
		t.Fatalf("service token: %+v, %v", p, err)
	}
	for _, args := range [][]string{
		{"token"},
		{"token", "--engine", "a", "--service", "b"},
		{"token", "--engine", "has space"},
		{"token", "--engine", "e", "--tenant", "bad@tenant"},
	} {
		if code := runCLI(t, args...).code; code == 0 {
			t.Errorf("kvmesh %v exited 0", args)
		}
	}
	t.Setenv("KVMESH_AUTH", "off")
	runCLI(t, "token", "--engine", "e").fails(t, "KVMESH_AUTH=off")
}
