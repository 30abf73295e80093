package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// credential is one way of calling a route in the security suite.
type credential struct {
	name   string
	header string    // the Authorization header; "" sends none
	kind   auth.Kind // the kind it is when valid; "" when it is not valid
	// engine is the engine a valid engine token names.
	engine string
}

// craftToken signs claims with secret as kvmesh would, so that the suite
// checks what the services accept independently of pkg/auth's minting.
func craftToken(t *testing.T, secret string, kind auth.Kind, sub string, exp time.Time) string {
	t.Helper()
	c := jwt.MapClaims{"iss": auth.Issuer, "sub": sub, "kvmesh_kind": string(kind), "iat": time.Now().Add(-2 * time.Hour).Unix(), "exp": exp.Unix(), "tenants": []string{"*"}}
	s, err := jwt.NewWithClaims(jwt.SigningMethodHS256, c).SignedString([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// credentials are every credential the suite tries on every route.
func (s *stack) credentials4Suite(t *testing.T) []credential {
	t.Helper()
	m := s.mesh
	svc, err := m.AuthKey.Mint(auth.KindService, "sender", nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	bearer := func(tok string) string { return "Bearer " + tok }
	return []credential{
		{name: "none"},
		{name: "not bearer", header: "Basic " + adminToken},
		{name: "garbage", header: bearer("not-a-token")},
		{name: "malformed", header: bearer("eyJhbGciOiJIUzI1NiJ9.e30.x")},
		{name: "expired", header: bearer(craftToken(t, m.AuthSecret, auth.KindEngine, decodeEngine, time.Now().Add(-time.Hour)))},
		{name: "other key", header: bearer(craftToken(t, strings.Repeat("k", 32), auth.KindEngine, decodeEngine, time.Now().Add(time.Hour)))},
		{name: "no kind", header: bearer(craftToken(t, m.AuthSecret, "", decodeEngine, time.Now().Add(time.Hour)))},
		{name: "operator", header: bearer(adminToken), kind: auth.KindOperator},
		{name: "engine", header: bearer(m.EngineToken(t, decodeEngine)), kind: auth.KindEngine, engine: decodeEngine},
		{name: "other engine", header: bearer(m.EngineToken(t, "intruder")), kind: auth.KindEngine, engine: "intruder"},
		{name: "service", header: bearer(svc), kind: auth.KindService},
	}
}

// pathParam fills a route template's {parameters}.
var pathParam = regexp.MustCompile(`\{[^}]+\}`)

// TestSecurityEveryRoute is the security suite: every route of every
// service, read from the OpenAPI document the service serves (so a new
// route without a rule fails here, and AccessRules refuses a document
// operation without one), is called with no credential, a wrong one, an
// expired or malformed one, one signed with another key, and with each
// kind: it answers 401 or 403 problem+json unless the credential is of a
// kind the route accepts (and, on a gpuworker, of its own engine). Then no
// secret appears in any service's log or /metrics.
func TestSecurityEveryRoute(t *testing.T) {
	recv := testenv.StartOTLPReceiver(t)
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64, env: []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.URL(), "OTEL_BSP_SCHEDULE_DELAY=100",
	}})
	creds := s.credentials4Suite(t)
	hc := &http.Client{Timeout: 10 * time.Second}
	defer hc.CloseIdleConnections()
	// The engine each service is: a gpuworker's, and for the lookup the
	// engine the suite's request bodies name.
	engineOf := map[string]string{"gpuworker": decodeEngine, "gpuworker-prefill": prefillEngine, "lookup": decodeEngine}
	checked := 0
	for _, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"} {
		base := s.url(name)
		doc := get(t, hc, base+httpserver.PathOpenAPI, "")
		rules, err := httpserver.AccessRules(doc)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for route, rule := range rules {
			path := pathParam.ReplaceAllString(route.Pattern, "1")
			for _, c := range creds {
				status := call(t, hc, route.Method, base+path, c.header, `{"engine_id":"`+decodeEngine+`"}`)
				reaches := rule.Public || c.kind != "" && slices.Contains(rule.Kinds, c.kind) && (c.kind != auth.KindEngine || c.engine == engineOf[name])
				switch {
				case reaches:
					if status == http.StatusUnauthorized || status == http.StatusForbidden {
						t.Errorf("%s %s (%s) with %s: %d, want it to reach the handler", name, route, rule, c.name, status)
					}
				case c.kind == "":
					if status != http.StatusUnauthorized {
						t.Errorf("%s %s (%s) with %s: %d, want 401", name, route, rule, c.name, status)
					}
				default:
					if status != http.StatusForbidden {
						t.Errorf("%s %s (%s) with %s: %d, want 403", name, route, rule, c.name, status)
					}
				}
				checked++
			}
		}
	}
	t.Logf("%d route × credential calls checked", checked)
	noSecretsIn(t, s, hc, creds)
	noSecretsInSpans(t, s, recv, creds)
}

// noSecretsInSpans waits until the services exported the server spans of
// the suite's lookups, then checks that no span's name, attributes or
// status holds a secret.
func noSecretsInSpans(t *testing.T, s *stack, recv *testenv.OTLPReceiver, creds []credential) {
	t.Helper()
	var spans []testenv.ExportedSpan
	deadline := time.Now().Add(20 * time.Second)
	for {
		var errs []error
		spans, errs = recv.Spans()
		if len(errs) > 0 {
			t.Fatalf("malformed OTLP exports: %v", errs)
		}
		if slices.ContainsFunc(spans, func(sp testenv.ExportedSpan) bool { return strings.Contains(sp.Name, "/v1/lookup") }) {
			break
		}
		if time.Now().After(deadline) {
			names := map[string]bool{}
			for _, sp := range spans {
				names[sp.Service+": "+sp.Name] = true
			}
			t.Fatalf("no span of a lookup call exported in 20s (%d spans: %v)", len(spans), names)
		}
		time.Sleep(50 * time.Millisecond) // polling interval of a deadline-bounded wait
	}
	secrets := suiteSecrets(s, creds)
	for _, sp := range spans {
		text := sp.Name + " " + sp.Status + " " + fmt.Sprint(sp.Attrs)
		for i, sec := range secrets {
			if strings.Contains(text, sec) {
				t.Errorf("span %s of %s holds secret %d", sp.Name, sp.Service, i)
			}
		}
	}
	t.Logf("%d spans checked", len(spans))
}

// suiteSecrets are the auth key, the operator token and every token the
// suite sent.
func suiteSecrets(s *stack, creds []credential) []string {
	secrets := []string{s.mesh.AuthSecret, adminToken}
	for _, c := range creds {
		if tok, ok := strings.CutPrefix(c.header, "Bearer "); ok && len(tok) > 16 {
			secrets = append(secrets, tok)
		}
	}
	return secrets
}

// TestPoisoningRefused: a write into an engine's KV pool with another
// engine's token, a service token or none is refused and the block keeps
// no identity; a put with an engine token is refused (puts are the
// sender's), and nothing reaches the store.
func TestPoisoningRefused(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "store", poolBlocks: 64})
	rdb := redis.NewClient(mustParseRedis(t, s.redisURL))
	defer rdb.Close()
	ctx := context.Background()
	keysBefore := countKeys(t, rdb, s.prefix)
	block := dataplane.Block{BlockRef: dataplane.BlockRef{Group: 0, Block: 7},
		Identity: dataplane.Identity{Hash: strings.Repeat("ab", 32), RequestID: "poison"}, Data: make([]byte, 64)}
	for _, tok := range []string{"", s.mesh.EngineToken(t, prefillEngine), mustMint(t, s, auth.KindService, "sender")} {
		hc := &http.Client{}
		if tok != "" {
			hc.Transport = auth.Transport(nil, auth.Static(tok))
		}
		err := dataplane.NewClient(s.url("gpuworker"), hc).Write(ctx, []dataplane.Block{block})
		if err == nil || !strings.Contains(err.Error(), "40") {
			t.Fatalf("a write with token %.12q was not refused: %v", tok, err)
		}
	}
	engine := &http.Client{Transport: auth.Transport(nil, auth.Static(s.mesh.EngineToken(t, decodeEngine)))}
	items := []dataplane.PutItem{{Key: s.prefix + "@poison", BlockRef: block.BlockRef, Hash: block.Identity.Hash}}
	if _, _, err := dataplane.NewClient(s.url("gpuworker"), engine).Put(ctx, items); err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("a put with an engine token was not refused: %v", err)
	}
	var pool struct {
		Groups []struct {
			InUse int `json:"in_use"`
		} `json:"groups"`
	}
	getJSON(t, s.url("gpuworker")+"/v1/pool", adminToken, &pool)
	for g, gr := range pool.Groups {
		if gr.InUse != 0 {
			t.Fatalf("group %d holds %d blocks after refused writes", g, gr.InUse)
		}
	}
	if n := countKeys(t, rdb, s.prefix); n != keysBefore {
		t.Fatalf("the store has %d keys under the prefix, %d before the refused writes", n, keysBefore)
	}
}

func mustMint(t *testing.T, s *stack, kind auth.Kind, sub string) string {
	t.Helper()
	tok, err := s.mesh.AuthKey.Mint(kind, sub, nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// call sends one request (with body post for POSTs) and returns the
// status; a refusal must be problem+json.
func call(t *testing.T, hc *http.Client, method, url, authz, post string) int {
	t.Helper()
	var body io.Reader
	if method == http.MethodPost {
		body = bytes.NewReader([]byte(post))
	}
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if authz != "" {
		req.Header.Set("Authorization", authz)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if (resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden) &&
		resp.Header.Get("Content-Type") != httpserver.ContentTypeProblem {
		t.Errorf("%s %s: %d as %q, want problem+json", method, url, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	return resp.StatusCode
}

// get GETs url and returns the body, failing the test unless it answers
// 200; token, when set, is sent as a bearer credential.
func get(t *testing.T, hc *http.Client, url, token string) []byte {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return b
}

// getJSON GETs url as get does and decodes the answer into out.
func getJSON(t *testing.T, url, token string, out any) {
	t.Helper()
	if err := json.Unmarshal(get(t, http.DefaultClient, url, token), out); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

// noSecretsIn checks every service's whole log and /metrics for the auth
// key, the operator token and every token the suite sent.
func noSecretsIn(t *testing.T, s *stack, hc *http.Client, creds []credential) {
	t.Helper()
	secrets := suiteSecrets(s, creds)
	for _, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"} {
		p := s.mesh.Procs.Process(name)
		texts := map[string]string{"log": p.LogTail(1 << 30), "/metrics": string(get(t, hc, p.URL()+httpserver.PathMetrics, ""))}
		if name == "sender" { // the dead letters' payload previews
			texts["/v1/dlq"] = string(get(t, hc, p.URL()+"/v1/dlq?limit=1000", adminToken))
		}
		for what, text := range texts {
			for i, sec := range secrets {
				if strings.Contains(text, sec) {
					t.Errorf("%s's %s holds secret %d", name, what, i)
				}
			}
		}
	}
}

func countKeys(t *testing.T, rdb *redis.Client, prefix string) int {
	t.Helper()
	n := 0
	iter := rdb.Scan(context.Background(), 0, prefix+"*", 1000).Iterator()
	for iter.Next(context.Background()) {
		n++
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestMeshOverTLSAndSASL runs the seed's configuration with every
// connection secured: the services serve HTTPS (the simulator and the
// services verify each other's certificates against the test CA), Kafka
// takes only TLS connections authenticated with SCRAM-SHA-512, Redis is
// TLS-only with an ACL user, PostgreSQL is reached with
// sslmode=verify-full, and every route is authenticated. The run must be
// clean: every request served, every loaded block byte-exact, the ledger
// balanced, stored values right.
func TestMeshOverTLSAndSASL(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64, secure: true})
	for _, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"} {
		if u := s.url(name); !strings.HasPrefix(u, "https://") {
			t.Fatalf("%s at %s: want HTTPS", name, u)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := smallWorkload(24, 4)
	rep, err := sim.Run(ctx, simConfig(t, s, true, w))
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if rep.Tokens.Loaded["pd"] == 0 {
		t.Fatalf("loaded tokens %v: want pd loads between the HTTPS gpuworkers", rep.Tokens.Loaded)
	}
	// Plain HTTP is not served.
	if resp, err := http.Get(strings.Replace(s.url("lookup"), "https://", "http://", 1) + "/readyz"); err == nil {
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("the lookup answered plain HTTP")
		}
	}
}
