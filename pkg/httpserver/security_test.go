package httpserver_test

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

const securityDoc = `openapi: 3.1.0
paths:
  /v1/open:
    get:
      security: []
  /v1/admin:
    post:
      security:
        - adminToken: []
  /v1/engine:
    post:
      security:
        - engineToken: []
  /v1/both:
    post:
      security:
        - engineToken: []
        - serviceToken: []
`

const securitySecret = "0123456789abcdef0123456789abcdef"

func mountSecured(s *httpserver.Server) {
	ok := func(w http.ResponseWriter, r *http.Request) {
		if p := auth.FromContext(r.Context()); p != nil {
			w.Header().Set("X-Principal", string(p.Kind)+":"+p.Subject)
		}
		w.WriteHeader(http.StatusNoContent)
	}
	s.Router().Get("/v1/open", ok)
	s.Router().Post("/v1/admin", ok)
	s.Router().Post("/v1/engine", ok)
	s.Router().Post("/v1/both", ok)
	s.Router().Post("/v1/undocumented", ok)
	s.ServeOpenAPI([]byte(securityDoc))
}

// TestAccessRules: each route admits exactly the credential kinds its
// OpenAPI security requirement names, refusing absent or bad credentials
// with 401 and others with 403, as problem+json.
func TestAccessRules(t *testing.T) {
	key, err := auth.NewKey(securitySecret)
	if err != nil {
		t.Fatal(err)
	}
	otherKey, _ := auth.NewKey(strings.Repeat("y", 32))
	mint := func(k auth.Key, kind auth.Kind, sub string, ttl time.Duration) string {
		s, err := k.Mint(kind, sub, nil, ttl)
		if err != nil {
			t.Fatal(err)
		}
		return "Bearer " + s
	}
	ts := start(t, httpserver.Options{Auth: auth.NewVerifier(key, "op-secret"), EngineID: "decode-0", AdminToken: "op-secret"}, mountSecured)
	engine := mint(key, auth.KindEngine, "decode-0", time.Hour)
	otherEngine := mint(key, auth.KindEngine, "decode-1", time.Hour)
	service := mint(key, auth.KindService, "sender", time.Hour)
	forged := mint(otherKey, auth.KindEngine, "decode-0", time.Hour)
	for _, tc := range []struct {
		method, path, authz string
		want                int
	}{
		{"GET", "/v1/open", "", http.StatusNoContent},
		{"GET", "/healthz", "", http.StatusOK},
		{"GET", "/metrics", "", http.StatusOK},
		{"POST", "/v1/admin", "", http.StatusUnauthorized},
		{"POST", "/v1/admin", "Bearer wrong", http.StatusUnauthorized},
		{"POST", "/v1/admin", engine, http.StatusForbidden},
		{"POST", "/v1/admin", "Bearer op-secret", http.StatusNoContent},
		{"POST", "/v1/engine", "", http.StatusUnauthorized},
		{"POST", "/v1/engine", "Basic b3A6c2VjcmV0", http.StatusUnauthorized},
		{"POST", "/v1/engine", engine, http.StatusNoContent},
		{"POST", "/v1/engine", otherEngine, http.StatusForbidden},
		{"POST", "/v1/engine", forged, http.StatusUnauthorized},
		{"POST", "/v1/engine", service, http.StatusForbidden},
		{"POST", "/v1/engine", "Bearer op-secret", http.StatusForbidden},
		{"POST", "/v1/both", service, http.StatusNoContent},
		{"POST", "/v1/both", engine, http.StatusNoContent},
		{"POST", "/v1/undocumented", "Bearer op-secret", http.StatusForbidden},
	} {
		res := ts.do(t, tc.method, tc.path, "", map[string]string{"Authorization": tc.authz})
		if tc.want >= 400 {
			p := res.problem(t, tc.want)
			if strings.Contains(string(res.body), "op-secret") || (tc.authz != "" && strings.Contains(string(res.body), strings.TrimPrefix(tc.authz, "Bearer "))) {
				t.Errorf("%s %s: the answer quotes the credential: %s (%+v)", tc.method, tc.path, res.body, p)
			}
			continue
		}
		if res.status != tc.want {
			t.Errorf("%s %s with %.20q: status %d, want %d; %s", tc.method, tc.path, tc.authz, res.status, tc.want, res.body)
		}
	}
	if got := ts.do(t, "POST", "/v1/engine", "", map[string]string{"Authorization": engine}).header.Get("X-Principal"); got != "engine:decode-0" {
		t.Errorf("principal in the handler's context = %q, want engine:decode-0", got)
	}
	if strings.Contains(ts.logs.String(), strings.TrimPrefix(engine, "Bearer ")) || strings.Contains(ts.logs.String(), "op-secret") {
		t.Error("a credential appears in the server's log")
	}
}

func TestAccessRulesOfDocuments(t *testing.T) {
	rules, err := httpserver.AccessRules([]byte(securityDoc))
	if err != nil {
		t.Fatal(err)
	}
	if got := rules[httpserver.Route{Method: "POST", Pattern: "/v1/both"}].String(); got != "engine or service" {
		t.Errorf("/v1/both rule %q", got)
	}
	for name, doc := range map[string]string{
		"no security":    "paths:\n  /x:\n    get:\n      summary: x\n",
		"unknown scheme": "paths:\n  /x:\n    get:\n      security:\n        - basicAuth: []\n",
	} {
		if _, err := httpserver.AccessRules([]byte(doc)); !errors.Is(err, httpserver.ErrAccessRules) {
			t.Errorf("%s: %v, want ErrAccessRules", name, err)
		}
	}
}

// TestServesTLS: with Options.TLS the server speaks HTTPS only, with the
// certificate a client verifies against the test CA.
func TestServesTLS(t *testing.T) {
	c := testenv.NewCerts(t)
	scfg, err := tlsfiles.Files{CertFile: c.ServerCert, KeyFile: c.ServerKey}.Server()
	if err != nil {
		t.Fatal(err)
	}
	ts := start(t, httpserver.Options{TLS: scfg}, nil)
	ccfg, err := tlsfiles.Files{CAFile: c.CAFile}.Client()
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: ccfg}, Timeout: 5 * time.Second}
	defer hc.CloseIdleConnections()
	url := strings.Replace(ts.url, "http://", "https://", 1)
	res, err := hc.Get(url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	_ = res.Body.Close()
	if res.StatusCode != http.StatusOK || res.TLS == nil {
		t.Fatalf("status %d, TLS %v", res.StatusCode, res.TLS != nil)
	}
	// Plain HTTP to the TLS port is answered with 400 (Go's TLS server),
	// never served.
	plain, err := http.Get(ts.url + "/healthz")
	if err == nil {
		_ = plain.Body.Close()
		if plain.StatusCode == http.StatusOK {
			t.Fatal("plain HTTP was served on the TLS port")
		}
	}
	distrust, _ := tlsfiles.Files{CAFile: c.OtherCAFile}.Client()
	bad := &http.Client{Transport: &http.Transport{TLSClientConfig: distrust}, Timeout: 5 * time.Second}
	if _, err := bad.Get(url + "/healthz"); err == nil {
		t.Fatal("a client trusting another CA connected")
	}
}
