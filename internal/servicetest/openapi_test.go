package servicetest_test

import (
	"fmt"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// recorder is a testing.TB that collects failures instead of failing.
type recorder struct {
	testing.TB
	mu     sync.Mutex
	failed []string
}

func (r *recorder) Helper() {}

func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = append(r.failed, fmt.Sprintf(format, args...))
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}

// failures runs check against a recorder and returns what it reported.
func failures(t *testing.T, check func(tb testing.TB)) []string {
	rec := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		check(rec)
	}()
	<-done
	return rec.failed
}

const goodDoc = `
openapi: 3.1.0
info: {title: test, version: "1"}
components:
  securitySchemes:
    adminToken: {type: http, scheme: bearer}
  parameters:
    ID: {name: id, in: path, required: true, schema: {type: integer}}
  schemas:
    Problem: {type: object}
paths:
  /v1/items:
    get:
      operationId: listItems
      parameters:
        - {name: limit, in: query, schema: {type: integer}}
      responses:
        200:
          description: ok
          content:
            application/json:
              schema: {type: array, items: {type: integer}}
  /v1/items/{id}/replay:
    parameters:
      - $ref: '#/components/parameters/ID'
    post:
      operationId: replayItem
      security: [{adminToken: []}]
      responses:
        "200": {description: ok}
        "401": {description: no token, content: {application/problem+json: {schema: {$ref: '#/components/schemas/Problem'}}}}
        "403": {description: wrong token}
        "404": {description: no such item}
`

var served = []httpserver.Route{
	{Method: "GET", Pattern: "/v1/items"},
	{Method: "POST", Pattern: "/v1/items/{id}/replay"},
}

func TestCheckOpenAPIAcceptsAMatchingDocument(t *testing.T) {
	got := failures(t, func(tb testing.TB) {
		d := servicetest.CheckOpenAPI(tb, served, []byte(goodDoc))
		if !d.Secured(served[1]) || d.Secured(served[0]) {
			tb.Errorf("Secured: replay %v, list %v", d.Secured(served[1]), d.Secured(served[0]))
		}
	})
	if len(got) != 0 {
		t.Fatalf("a matching document was refused: %q", got)
	}
}

func TestCheckOpenAPIFindsDisagreements(t *testing.T) {
	tests := []struct {
		name   string
		served []httpserver.Route
		edit   func(string) string
		want   string
	}{
		{"served, not documented", append(slices.Clone(served), httpserver.Route{Method: "DELETE", Pattern: "/v1/items"}), nil,
			"served but not documented: DELETE /v1/items"},
		{"documented, not served", served[:1], nil, "documented but not served: POST /v1/items/{id}/replay"},
		{"undeclared path parameter", served, func(s string) string {
			return strings.Replace(s, "    parameters:\n      - $ref: '#/components/parameters/ID'\n", "", 1)
		}, "POST /v1/items/{id}/replay must define exactly all path parameters (missing: [id])"},
		{"extra path parameter", served, func(s string) string {
			return strings.Replace(s, "{name: limit, in: query", "{name: limit, in: path, required: true", 1)
		}, "GET /v1/items must define exactly all path parameters (missing: [limit])"},
		{"dangling $ref", served, func(s string) string {
			return strings.Replace(s, "schemas/Problem'", "schemas/Nope'", 1)
		}, `"#/components/schemas/Nope": map key "Nope" not found`},
		{"unknown scheme", served, func(s string) string {
			return strings.Replace(s, "[{adminToken: []}]", "[{other: []}]", 1)
		}, `security scheme "other"`},
		{"secured without 403", served, func(s string) string {
			return strings.Replace(s, `        "403": {description: wrong token}`+"\n", "", 1)
		}, "does not document 403"},
		{"duplicate operationId", served, func(s string) string {
			return strings.Replace(s, "operationId: replayItem", "operationId: listItems", 1)
		}, `same operation id "listItems"`},
		{"optional path parameter", served, func(s string) string {
			return strings.Replace(s, "ID: {name: id, in: path, required: true,", "ID: {name: id, in: path,", 1)
		}, "path parameter {id} must be required: true"},
		{"bad schema", served, func(s string) string {
			return strings.Replace(s, "{type: array, items: {type: integer}}", "{type: arrays}", 1)
		}, "arrays"},
		{"not 3.1", served, func(s string) string { return strings.Replace(s, "3.1.0", "3.0.3", 1) }, "want 3.1.x"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			doc := goodDoc
			if tt.edit != nil {
				doc = tt.edit(doc)
				if doc == goodDoc {
					t.Fatal("the edit changed nothing")
				}
			}
			got := failures(t, func(tb testing.TB) { servicetest.CheckOpenAPI(tb, tt.served, []byte(doc)) })
			if !slices.ContainsFunc(got, func(s string) bool { return strings.Contains(s, tt.want) }) {
				t.Fatalf("failures %q, want one containing %q", got, tt.want)
			}
		})
	}
}

func TestCheckAdminAuthProbesTheServer(t *testing.T) {
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0", AdminToken: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	var replayed atomic.Int32
	noop := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }
	srv.Router().Get("/v1/items", noop)
	srv.Router().With(srv.RequireAdmin()).Post("/v1/items/{id}/replay", func(w http.ResponseWriter, r *http.Request) {
		if chi.URLParam(r, "id") == "7" {
			replayed.Add(1)
		}
		w.WriteHeader(http.StatusNotFound)
	})
	srv.Router().Post("/v1/open/{id}", noop) // documented as secured, but not guarded
	srv.Router().Delete("/v1/items", noop)   // mutating, not secured
	srv.Router().Post("/v1/engine", noop)    // not secured either
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, srv.Run)
	servicetest.WaitReady(t, srv.Addr())
	doc := goodDoc + `  /v1/open/{id}:
    post:
      operationId: open
      security: [{adminToken: []}]
      parameters: [{$ref: '#/components/parameters/ID'}]
      responses: {"200": {description: ok}, "401": {description: x}, "403": {description: x}}
  /v1/engine:
    post:
      operationId: engine
      responses: {"200": {description: ok}}
`
	d := servicetest.ParseOpenAPI(t, []byte(doc))
	routes := srv.Routes()
	got := failures(t, func(tb testing.TB) {
		servicetest.CheckAdminAuth(tb, "http://"+srv.Addr(), "tok", routes, d, map[string]string{"id": "7"})
	})
	want := []string{
		"POST /v1/engine mutates but is not secured",
		"DELETE /v1/items mutates but is not secured",
		"POST /v1/open/{id} with a missing token: 200",
		"POST /v1/open/{id} with a missing token: WWW-Authenticate",
		"POST /v1/open/{id} with a wrong token: 200",
		"POST /v1/open/{id} with a wrong token: WWW-Authenticate",
	}
	if len(got) != len(want) {
		t.Fatalf("failures %q, want %d", got, len(want))
	}
	for i, w := range want {
		if !strings.HasPrefix(got[i], w) {
			t.Errorf("failure %d = %q, want it to start with %q", i, got[i], w)
		}
	}
	if n := replayed.Load(); n != 1 {
		t.Fatalf("the replay route ran %d times for id 7, want once (with the right token)", n)
	}
}

func TestCheckResponseValidatesAgainstTheDocument(t *testing.T) {
	d := servicetest.ParseOpenAPI(t, []byte(goodDoc))
	list, replay := served[0], served[1]
	tests := []struct {
		name   string
		route  httpserver.Route
		status int
		ct     string
		body   string
		want   string // "" when the response conforms
	}{
		{"conforming body", list, 200, "application/json", "[1, 2]", ""},
		{"documented status without content", replay, 403, "", "", ""},
		{"problem body", replay, 401, "application/problem+json", `{"title": "x"}`, ""},
		{"undocumented status", list, 500, "application/json", "[]", "status is not supported"},
		{"wrong content type", list, 200, "text/plain", "1", `"text/plain"`},
		{"body against the schema", list, 200, "application/json", `["a"]`, "doesn't match schema"},
		{"problem that is not an object", replay, 401, "application/problem+json", `"x"`, "doesn't match schema"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequest(tt.route.Method, "http://127.0.0.1"+strings.ReplaceAll(tt.route.Pattern, "{id}", "1"), nil)
			if err != nil {
				t.Fatal(err)
			}
			header := http.Header{}
			if tt.ct != "" {
				header.Set("Content-Type", tt.ct)
			}
			got := failures(t, func(tb testing.TB) {
				d.CheckResponse(tb, tt.route, req, tt.status, header, []byte(tt.body))
			})
			switch {
			case tt.want == "" && len(got) != 0:
				t.Fatalf("a conforming response was refused: %q", got)
			case tt.want != "" && (len(got) != 1 || !strings.Contains(got[0], tt.want) || !strings.HasPrefix(got[0], tt.route.String())):
				t.Fatalf("failures %q, want one naming %s and containing %q", got, tt.route, tt.want)
			}
		})
	}
}
