package httpserver

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"

	"github.com/go-chi/chi/v5"
	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/pkg/auth"
)

// Security scheme names of the OpenAPI documents, and the credential kind
// each one is.
const (
	// SchemeAdmin is the operator token (KVMESH_ADMIN_TOKEN).
	SchemeAdmin = "adminToken"
	// SchemeEngine is an engine token.
	SchemeEngine = "engineToken"
	// SchemeService is a service token.
	SchemeService = "serviceToken"
)

// schemeKinds maps each security scheme to its credential kind.
var schemeKinds = map[string]auth.Kind{
	SchemeAdmin:   auth.KindOperator,
	SchemeEngine:  auth.KindEngine,
	SchemeService: auth.KindService,
}

// ErrAccessRules reports an OpenAPI document whose security requirements
// cannot be turned into access rules: an operation without one, or an
// unknown scheme.
var ErrAccessRules = errors.New("httpserver: access rules")

// Rule is who may call one route: nobody needs a credential when Public,
// else a credential of one of Kinds.
type Rule struct {
	// Public routes need no credential (probes, metrics, the document).
	Public bool
	// Kinds are the credential kinds accepted.
	Kinds []auth.Kind
}

// String formats the rule as in the closing tables: "public" or the kinds
// joined by " or ".
func (r Rule) String() string {
	if r.Public {
		return "public"
	}
	ks := make([]string, len(r.Kinds))
	for i, k := range r.Kinds {
		ks[i] = string(k)
	}
	return strings.Join(ks, " or ")
}

// AccessRules reads the access rule of every operation of an OpenAPI
// document from its security requirements: `security: []` is public, and
// each listed scheme (adminToken, engineToken, serviceToken) is a kind of
// credential accepted. Every operation must state one.
func AccessRules(doc []byte) (map[Route]Rule, error) {
	var d struct {
		Paths map[string]map[string]struct {
			Security *[]map[string][]string `yaml:"security"`
		} `yaml:"paths"`
	}
	if err := yaml.Unmarshal(doc, &d); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrAccessRules, err)
	}
	out := map[Route]Rule{}
	var errs []error
	for path, ops := range d.Paths {
		for method, op := range ops {
			route := Route{Method: strings.ToUpper(method), Pattern: path}
			if op.Security == nil {
				errs = append(errs, fmt.Errorf("%w: %s states no security requirement", ErrAccessRules, route))
				continue
			}
			rule, err := ruleOf(*op.Security)
			if err != nil {
				errs = append(errs, fmt.Errorf("%w: %s: %w", ErrAccessRules, route, err))
				continue
			}
			out[route] = rule
		}
	}
	sort.Slice(errs, func(i, j int) bool { return errs[i].Error() < errs[j].Error() })
	return out, errors.Join(errs...)
}

// ruleOf turns one operation's security requirements into a rule.
func ruleOf(reqs []map[string][]string) (Rule, error) {
	if len(reqs) == 0 {
		return Rule{Public: true}, nil
	}
	var r Rule
	for _, req := range reqs {
		for name := range req {
			k, ok := schemeKinds[name]
			if !ok {
				return Rule{}, fmt.Errorf("unknown security scheme %q", name)
			}
			if !slices.Contains(r.Kinds, k) {
				r.Kinds = append(r.Kinds, k)
			}
		}
	}
	slices.Sort(r.Kinds)
	return r, nil
}

// access holds a server's rules once ServeOpenAPI has read them.
type access struct {
	rules map[Route]Rule
	err   error
}

// authorize is the middleware that enforces the access rules when the
// server has a verifier (Options.Auth): the route the request matches is
// looked up, a public one passes, any other needs a bearer credential of
// an accepted kind (401 when absent or not valid, 403 when of another
// kind, or an engine token of another engine than Options.EngineID). The
// verified principal is in the request's context (auth.FromContext). A
// route without a rule is refused (fail closed). Tokens are never logged.
func (s *Server) authorize(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.opts.Auth == nil {
			next.ServeHTTP(w, r)
			return
		}
		pattern := s.mux.Find(chi.NewRouteContext(), r.Method, r.URL.Path)
		if pattern == "" {
			next.ServeHTTP(w, r) // 404 or 405 from the router
			return
		}
		rule, ok := s.access.rules[Route{Method: r.Method, Pattern: pattern}]
		switch {
		case !ok && isBuiltinPublic(pattern):
			next.ServeHTTP(w, r)
			return
		case !ok:
			WriteProblem(w, r, http.StatusForbidden, "", "this route has no access rule in the service's OpenAPI document, so it is refused", nil)
			return
		case rule.Public:
			next.ServeHTTP(w, r)
			return
		}
		p, status, detail := s.check(r, rule)
		if p == nil {
			if status == http.StatusUnauthorized {
				w.Header().Set("WWW-Authenticate", `Bearer realm="kvmesh"`)
			}
			WriteProblem(w, r, status, "", detail, map[string]any{"accepts": rule.String()})
			return
		}
		next.ServeHTTP(w, r.WithContext(auth.NewContext(r.Context(), p)))
	})
}

// check verifies the request's credential against rule.
func (s *Server) check(r *http.Request, rule Rule) (*auth.Principal, int, string) {
	token, ok := bearerToken(r.Header.Get("Authorization"))
	if !ok {
		return nil, http.StatusUnauthorized, "this route needs an Authorization: Bearer header with a credential of kind " + rule.String()
	}
	p, err := s.opts.Auth.Verify(token)
	if err != nil {
		return nil, http.StatusUnauthorized, err.Error()
	}
	if !slices.Contains(rule.Kinds, p.Kind) {
		return nil, http.StatusForbidden, fmt.Sprintf("a credential of kind %s does not reach this route (it accepts %s)", p.Kind, rule)
	}
	if p.Kind == auth.KindEngine && s.opts.EngineID != "" && p.Subject != s.opts.EngineID {
		return nil, http.StatusForbidden, fmt.Sprintf("this is engine %s's service; the token is engine %s's", s.opts.EngineID, p.Subject)
	}
	return p, 0, ""
}

// isBuiltinPublic reports the built-in routes that are public even on a
// server whose document does not list them.
func isBuiltinPublic(pattern string) bool {
	switch pattern {
	case PathHealth, PathReady, PathMetrics, PathOpenAPI:
		return true
	}
	return false
}

// AccessRules returns the rules the server enforces, read from the
// document given to ServeOpenAPI (nil before).
func (s *Server) AccessRules() map[Route]Rule { return s.access.rules }
