package servicetest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// PublicExtension is the operation member of an OpenAPI document that marks
// a mutating route as deliberately open (no admin token); its value says
// why (e.g. "engine API" or "data plane: cluster-internal").
const PublicExtension = "x-kvmesh-public"

// operationMethods are the OpenAPI path-item members that are operations.
var operationMethods = []string{"get", "put", "post", "delete", "options", "head", "patch", "trace"}

// pathParam matches a {name} parameter of a path template.
var pathParam = regexp.MustCompile(`\{([^{}/]+)\}`)

// OpenAPI is a parsed OpenAPI document, as far as the route checks read it.
type OpenAPI struct {
	doc        map[string]any
	operations map[httpserver.Route]operation
	schemes    map[string]bool
}

// operation is one documented operation.
type operation struct {
	params    []parameter
	responses map[string]any
	security  []map[string]any
	secured   bool
	public    string
	id        string
}

// parameter is a resolved parameter object.
type parameter struct {
	Name     string `yaml:"name"`
	In       string `yaml:"in"`
	Required bool   `yaml:"required"`
}

// ParseOpenAPI parses an OpenAPI 3.1 document, failing the test when it is
// not YAML or lacks the members the checks need.
func ParseOpenAPI(t testing.TB, doc []byte) *OpenAPI {
	t.Helper()
	var root map[string]any
	if err := yaml.Unmarshal(doc, &root); err != nil {
		t.Fatalf("OpenAPI document: %v", err)
	}
	if v, _ := root["openapi"].(string); !strings.HasPrefix(v, "3.1.") {
		t.Fatalf("OpenAPI document: openapi = %q, want 3.1.x", v)
	}
	d := &OpenAPI{doc: root, operations: map[httpserver.Route]operation{}, schemes: map[string]bool{}}
	for name := range mapAt(root, "components", "securitySchemes") {
		d.schemes[name] = true
	}
	global, _ := root["security"].([]any)
	paths, ok := root["paths"].(map[string]any)
	if !ok {
		t.Fatal("OpenAPI document: no paths")
	}
	for path, item := range paths {
		d.addPath(t, path, asMap(item), global)
	}
	return d
}

// addPath records the operations of one path item.
func (d *OpenAPI) addPath(t testing.TB, path string, item map[string]any, global []any) {
	t.Helper()
	shared := d.parameters(t, path, item["parameters"])
	for _, m := range operationMethods {
		raw, ok := item[m]
		if !ok {
			continue
		}
		op := asMap(raw)
		o := operation{responses: asMap(op["responses"])}
		o.id, _ = op["operationId"].(string)
		o.public, _ = op[PublicExtension].(string)
		o.params = mergeParams(shared, d.parameters(t, path, op["parameters"]))
		sec, declared := op["security"].([]any)
		if !declared {
			sec = global
		}
		for _, req := range sec {
			if r := asMap(req); len(r) > 0 {
				o.security = append(o.security, r)
			}
		}
		o.secured = len(o.security) > 0
		d.operations[httpserver.Route{Method: strings.ToUpper(m), Pattern: path}] = o
	}
}

// parameters resolves a parameters list, following local $refs.
func (d *OpenAPI) parameters(t testing.TB, path string, raw any) []parameter {
	t.Helper()
	list, _ := raw.([]any)
	out := make([]parameter, 0, len(list))
	for i, p := range list {
		m := asMap(p)
		if ref, ok := m["$ref"].(string); ok {
			target, err := d.resolve(ref)
			if err != nil {
				t.Fatalf("OpenAPI %s: parameters[%d]: %v", path, i, err)
			}
			m = asMap(target)
		}
		var param parameter
		param.Name, _ = m["name"].(string)
		param.In, _ = m["in"].(string)
		param.Required, _ = m["required"].(bool)
		out = append(out, param)
	}
	return out
}

// mergeParams lets operation parameters override path-item ones of the
// same name and location.
func mergeParams(shared, own []parameter) []parameter {
	out := slices.Clone(own)
	for _, p := range shared {
		if !slices.ContainsFunc(own, func(q parameter) bool { return q.Name == p.Name && q.In == p.In }) {
			out = append(out, p)
		}
	}
	return out
}

// resolve follows a local reference such as #/components/schemas/Problem.
func (d *OpenAPI) resolve(ref string) (any, error) {
	rest, ok := strings.CutPrefix(ref, "#/")
	if !ok {
		return nil, fmt.Errorf("$ref %q is not a local reference", ref)
	}
	var cur any = d.doc
	for _, part := range strings.Split(rest, "/") {
		part = strings.ReplaceAll(strings.ReplaceAll(part, "~1", "/"), "~0", "~")
		var ok bool
		if cur, ok = asMap(cur)[part]; !ok {
			return nil, fmt.Errorf("$ref %q does not resolve", ref)
		}
	}
	return cur, nil
}

// Routes lists the documented operations as routes, sorted.
func (d *OpenAPI) Routes() []httpserver.Route {
	out := make([]httpserver.Route, 0, len(d.operations))
	for r := range d.operations {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b httpserver.Route) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// Secured reports whether the document requires a security scheme (the
// admin bearer token) for route.
func (d *OpenAPI) Secured(r httpserver.Route) bool { return d.operations[r].secured }

// CheckOpenAPI fails the test unless doc documents exactly the served
// routes (a served route missing from the document and a documented route
// not served are both reported), and the document is sound: every {name}
// of a path template is declared as a required path parameter (and no
// other path parameter is), every operation has an operationId of its own
// and responses, every local $ref resolves, every security requirement
// names a declared scheme, and secured operations document 401 and 403.
// It returns the parsed document.
func CheckOpenAPI(t testing.TB, served []httpserver.Route, doc []byte) *OpenAPI {
	t.Helper()
	d := ParseOpenAPI(t, doc)
	documented := d.Routes()
	for _, r := range served {
		if _, ok := d.operations[r]; !ok {
			t.Errorf("served but not documented: %s", r)
		}
	}
	for _, r := range documented {
		if !slices.Contains(served, r) {
			t.Errorf("documented but not served: %s", r)
		}
	}
	ids := map[string]httpserver.Route{}
	for _, r := range documented {
		op := d.operations[r]
		d.checkOperation(t, r, op)
		if prev, dup := ids[op.id]; dup {
			t.Errorf("%s: operationId %q is also %s's", r, op.id, prev)
		}
		ids[op.id] = r
	}
	d.checkRefs(t, "#", d.doc)
	return d
}

// checkOperation checks one operation's id, responses, path parameters and
// security.
func (d *OpenAPI) checkOperation(t testing.TB, r httpserver.Route, op operation) {
	t.Helper()
	if op.id == "" {
		t.Errorf("%s: no operationId", r)
	}
	if len(op.responses) == 0 {
		t.Errorf("%s: no responses", r)
	}
	var inTemplate []string
	for _, m := range pathParam.FindAllStringSubmatch(r.Pattern, -1) {
		inTemplate = append(inTemplate, m[1])
	}
	for _, name := range inTemplate {
		i := slices.IndexFunc(op.params, func(p parameter) bool { return p.In == "path" && p.Name == name })
		if i < 0 {
			t.Errorf("%s: path parameter {%s} is not declared", r, name)
		} else if !op.params[i].Required {
			t.Errorf("%s: path parameter {%s} must be required: true", r, name)
		}
	}
	for _, p := range op.params {
		if p.In == "path" && !slices.Contains(inTemplate, p.Name) {
			t.Errorf("%s: declares path parameter %q that the template lacks", r, p.Name)
		}
	}
	for _, req := range op.security {
		for name := range req {
			if !d.schemes[name] {
				t.Errorf("%s: security scheme %q is not in components.securitySchemes", r, name)
			}
		}
	}
	if op.secured {
		for _, code := range []string{"401", "403"} {
			if _, ok := op.responses[code]; !ok {
				t.Errorf("%s: secured but does not document %s", r, code)
			}
		}
	}
}

// checkRefs fails the test for every local $ref below node that does not
// resolve.
func (d *OpenAPI) checkRefs(t testing.TB, at string, node any) {
	t.Helper()
	switch n := node.(type) {
	case map[string]any:
		if ref, ok := n["$ref"].(string); ok {
			if _, err := d.resolve(ref); err != nil {
				t.Errorf("%s: %v", at, err)
			}
		}
		for k, v := range n {
			d.checkRefs(t, at+"/"+k, v)
		}
	case map[any]any:
		d.checkRefs(t, at, asMap(n))
	case []any:
		for i, v := range n {
			d.checkRefs(t, fmt.Sprintf("%s/%d", at, i), v)
		}
	}
}

// CheckAdminAuth probes the running service at baseURL (http://host:port)
// and fails the test unless every mutating route it serves (any method but
// GET, HEAD and OPTIONS) is either secured in the document or marked
// deliberately open with x-kvmesh-public, and every secured operation
// answers 401 (problem+json, with a Bearer challenge) without a token, 403
// (problem+json) with a wrong one, and neither with token. Open mutating
// routes must not ask for a token. Path parameters are filled from values
// ("1" when absent); requests have no body.
func CheckAdminAuth(t testing.TB, baseURL, token string, served []httpserver.Route, d *OpenAPI, values map[string]string) {
	t.Helper()
	for _, r := range served {
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			continue
		}
		if op := d.operations[r]; !op.secured && op.public == "" {
			t.Errorf("%s mutates but is neither secured nor marked %s", r, PublicExtension)
		}
	}
	for _, r := range d.Routes() {
		op := d.operations[r]
		target := baseURL + fillPath(r.Pattern, values)
		switch {
		case op.secured:
			checkSecured(t, r, target, token)
		case op.public != "" && slices.Contains(served, r):
			if code, _, body := send(t, r.Method, target, ""); code == http.StatusUnauthorized || code == http.StatusForbidden {
				t.Errorf("%s is open but answered %d without a token: %s", r, code, body)
			}
		}
	}
}

// checkSecured probes one secured route with no, a wrong and the right
// token.
func checkSecured(t testing.TB, r httpserver.Route, target, token string) {
	t.Helper()
	tests := []struct {
		name, auth string
		want       int
	}{
		{"missing token", "", http.StatusUnauthorized},
		{"wrong token", "Bearer wrong-" + token, http.StatusForbidden},
		{"right token", "Bearer " + token, 0},
	}
	for _, tt := range tests {
		code, header, body := send(t, r.Method, target, tt.auth)
		if tt.want == 0 {
			if code == http.StatusUnauthorized || code == http.StatusForbidden {
				t.Errorf("%s with the %s: %d %s, want the route to run", r, tt.name, code, body)
			}
			continue
		}
		if code != tt.want || header.Get("Content-Type") != httpserver.ContentTypeProblem {
			t.Errorf("%s with a %s: %d %q %s, want %d problem+json", r, tt.name, code, header.Get("Content-Type"), body, tt.want)
		}
		if tt.want == http.StatusUnauthorized && !strings.HasPrefix(header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("%s with a %s: WWW-Authenticate %q, want a Bearer challenge", r, tt.name, header.Get("WWW-Authenticate"))
		}
	}
}

// send makes one request without a body and returns status, header and
// body.
func send(t testing.TB, method, target, auth string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, target, nil)
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096)) // for messages only
	return resp.StatusCode, resp.Header, string(b)
}

// fillPath replaces every {name} of a template by values[name] or "1".
func fillPath(pattern string, values map[string]string) string {
	return pathParam.ReplaceAllStringFunc(pattern, func(m string) string {
		if v, ok := values[m[1:len(m)-1]]; ok {
			return v
		}
		return "1"
	})
}

// mapAt walks nested maps along keys; nil when any is missing.
func mapAt(m map[string]any, keys ...string) map[string]any {
	for _, k := range keys {
		m = asMap(m[k])
	}
	return m
}

// asMap returns v as a map, or nil. A YAML mapping with keys that are not
// all strings (an unquoted status code such as 200) has its keys formatted
// as strings.
func asMap(v any) map[string]any {
	switch m := v.(type) {
	case map[string]any:
		return m
	case map[any]any:
		out := make(map[string]any, len(m))
		for k, x := range m {
			out[fmt.Sprint(k)] = x
		}
		return out
	}
	return nil
}

// CheckServedOpenAPI fetches the document a running service serves at
// httpserver.PathOpenAPI from addr, fails unless it is embedded (the one the
// service embeds), and checks it against the served routes with
// CheckOpenAPI.
func CheckServedOpenAPI(t testing.TB, addr string, served []httpserver.Route, embedded []byte) *OpenAPI {
	t.Helper()
	resp, err := http.Get("http://" + addr + httpserver.PathOpenAPI)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	doc, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK || !bytes.Equal(doc, embedded) {
		t.Fatalf("GET %s: %d, %d bytes, %v; want the embedded document", httpserver.PathOpenAPI, resp.StatusCode, len(doc), err)
	}
	return CheckOpenAPI(t, served, doc)
}
