package httpserver

import (
	"cmp"
	"net/http"
	"slices"

	"github.com/go-chi/chi/v5"
)

// Route is one method and path template that a router serves, such as
// GET /v1/dlq/{id}.
type Route struct {
	// Method is the HTTP method in upper case.
	Method string
	// Pattern is the chi path template, with {name} path parameters.
	Pattern string
}

// String formats the route as "METHOD pattern".
func (r Route) String() string { return r.Method + " " + r.Pattern }

// Routes lists every route the server serves, the built-in ones included,
// sorted by pattern and then method. Call it once the service has mounted
// its routes: it is the served truth that an OpenAPI document is checked
// against.
func (s *Server) Routes() []Route {
	s.Handler() // mounts the built-in routes
	return RoutesOf(s.mux)
}

// RoutesOf lists the routes of a chi router, sub-routers included, sorted
// by pattern and then method.
func RoutesOf(r chi.Routes) []Route {
	var out []Route
	// The walk function never fails, so neither does Walk.
	_ = chi.Walk(r, func(method, pattern string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		out = append(out, Route{Method: method, Pattern: pattern})
		return nil
	})
	slices.SortFunc(out, func(a, b Route) int {
		return cmp.Or(cmp.Compare(a.Pattern, b.Pattern), cmp.Compare(a.Method, b.Method))
	})
	return slices.Compact(out)
}
