package httpserver_test

import (
	"net/http"
	"slices"
	"testing"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

func TestRoutesListsServedRoutes(t *testing.T) {
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	noop := func(http.ResponseWriter, *http.Request) {}
	srv.Router().Get("/v1/items", noop)
	srv.Router().With(srv.RequireAdmin()).Post("/v1/items/{id}/replay", noop)
	srv.Router().Route("/v1/sub", func(r chi.Router) {
		r.Get("/{name}", noop)
		r.Delete("/{name}", noop)
	})
	srv.ServeOpenAPI([]byte("openapi: 3.1.0\n"))
	got := srv.Routes()
	want := []httpserver.Route{
		{Method: "GET", Pattern: "/healthz"},
		{Method: "GET", Pattern: "/metrics"},
		{Method: "GET", Pattern: "/openapi.yaml"},
		{Method: "GET", Pattern: "/readyz"},
		{Method: "GET", Pattern: "/v1/items"},
		{Method: "POST", Pattern: "/v1/items/{id}/replay"},
		{Method: "DELETE", Pattern: "/v1/sub/{name}"},
		{Method: "GET", Pattern: "/v1/sub/{name}"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("Routes() =\n%v\nwant\n%v", got, want)
	}
	if s := want[5].String(); s != "POST /v1/items/{id}/replay" {
		t.Fatalf("String() = %q", s)
	}
}

func TestServeOpenAPI(t *testing.T) {
	doc := []byte("openapi: 3.1.0\ninfo: {title: test, version: '1'}\npaths: {}\n")
	ts := start(t, httpserver.Options{}, func(s *httpserver.Server) { s.ServeOpenAPI(doc) })
	res := ts.do(t, http.MethodGet, httpserver.PathOpenAPI, "", nil)
	if res.status != http.StatusOK || string(res.body) != string(doc) ||
		res.header.Get("Content-Type") != httpserver.ContentTypeYAML {
		t.Fatalf("GET /openapi.yaml: %d %q %q", res.status, res.header.Get("Content-Type"), res.body)
	}
}
