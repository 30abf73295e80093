package servicetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// pathParam matches a {name} parameter of a path template.
var pathParam = regexp.MustCompile(`\{([^{}/]+)\}`)

// maxProbeBody bounds how much of a probed response is read and validated.
const maxProbeBody = 1 << 20

// OpenAPI is an OpenAPI 3.1 document loaded, with every $ref resolved, by
// kin-openapi, indexed by route.
type OpenAPI struct {
	doc        *openapi3.T
	operations map[httpserver.Route]*openapi3.Operation
}

// ParseOpenAPI loads an OpenAPI 3.1 document, resolving its local $refs,
// and fails the test when it is not a document, a $ref does not resolve
// (external references are refused), or the version is not 3.1.x.
func ParseOpenAPI(t testing.TB, doc []byte) *OpenAPI {
	t.Helper()
	loader := openapi3.NewLoader()
	loader.IsExternalRefsAllowed = false
	parsed, err := loader.LoadFromData(doc)
	if err != nil {
		t.Fatalf("OpenAPI document: %v", err)
	}
	if !strings.HasPrefix(parsed.OpenAPI, "3.1.") {
		t.Fatalf("OpenAPI document: openapi = %q, want 3.1.x", parsed.OpenAPI)
	}
	if parsed.Paths == nil || parsed.Paths.Len() == 0 {
		t.Fatal("OpenAPI document: no paths")
	}
	d := &OpenAPI{doc: parsed, operations: map[httpserver.Route]*openapi3.Operation{}}
	for path, item := range parsed.Paths.Map() {
		for method, op := range item.Operations() {
			d.operations[httpserver.Route{Method: strings.ToUpper(method), Pattern: path}] = op
		}
	}
	return d
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
// admin bearer token) for route: the operation's security, or the
// document's when the operation declares none, holds a requirement that
// names a scheme.
func (d *OpenAPI) Secured(r httpserver.Route) bool {
	op := d.operations[r]
	if op == nil {
		return false
	}
	reqs := d.doc.Security
	if op.Security != nil {
		reqs = *op.Security
	}
	return slices.ContainsFunc(reqs, func(req openapi3.SecurityRequirement) bool { return len(req) > 0 })
}

// CheckOpenAPI fails the test unless doc documents exactly the served
// routes (a served route missing from the document and a documented route
// not served are both reported), and the document is sound: it passes
// kin-openapi's validation of OpenAPI 3.1 (every $ref resolves, the path
// parameters of each operation are exactly the {name}s of its template,
// operation ids are unique, security requirements name declared schemes,
// schemas are valid JSON Schema 2020-12), every path parameter is
// required: true, every operation has an operationId and responses, and
// secured operations document 401 and 403. It returns the loaded document.
func CheckOpenAPI(t testing.TB, served []httpserver.Route, doc []byte) *OpenAPI {
	t.Helper()
	d := ParseOpenAPI(t, doc)
	if err := d.doc.Validate(context.Background(), openapi3.EnableMultiError()); err != nil {
		var multi openapi3.MultiError
		if errors.As(err, &multi) {
			for _, e := range multi {
				t.Errorf("OpenAPI document: %v", e)
			}
		} else {
			t.Errorf("OpenAPI document: %v", err)
		}
	}
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
		d.checkOperation(t, r)
	}
	return d
}

// checkOperation checks what kin-openapi's validation leaves to the
// project: an operationId and responses on every operation, path
// parameters required, and 401 and 403 on secured operations.
func (d *OpenAPI) checkOperation(t testing.TB, r httpserver.Route) {
	t.Helper()
	op := d.operations[r]
	if op.OperationID == "" {
		t.Errorf("%s: no operationId", r)
	}
	if op.Responses == nil || op.Responses.Len() == 0 {
		t.Errorf("%s: no responses", r)
	}
	item := d.doc.Paths.Value(r.Pattern)
	for _, refs := range []openapi3.Parameters{item.Parameters, op.Parameters} {
		for _, ref := range refs {
			if p := ref.Value; p != nil && p.In == openapi3.ParameterInPath && !p.Required {
				t.Errorf("%s: path parameter {%s} must be required: true", r, p.Name)
			}
		}
	}
	if d.Secured(r) {
		for _, code := range []int{http.StatusUnauthorized, http.StatusForbidden} {
			if op.Responses.Status(code) == nil {
				t.Errorf("%s: secured but does not document %d", r, code)
			}
		}
	}
}

// CheckResponse fails the test unless the response the service gave to req
// for route r (status, header and body) is one the document declares for
// r's operation: the status is documented (or covered by default), the
// Content-Type is one of that response's media types, its documented
// headers match their schemas, and the body validates against the media
// type's schema (JSON Schema 2020-12).
func (d *OpenAPI) CheckResponse(t testing.TB, r httpserver.Route, req *http.Request, status int, header http.Header, body []byte) {
	t.Helper()
	if err := d.validateResponse(r, req, status, header, body); err != nil {
		t.Errorf("%s answered %d %q, which its OpenAPI document does not allow: %v", r, status, header.Get("Content-Type"), err)
	}
}

// validateResponse validates one response with openapi3filter.
func (d *OpenAPI) validateResponse(r httpserver.Route, req *http.Request, status int, header http.Header, body []byte) error {
	op := d.operations[r]
	if op == nil {
		return fmt.Errorf("%s is not documented", r)
	}
	route := &routers.Route{
		Spec:      d.doc,
		Path:      r.Pattern,
		PathItem:  d.doc.Paths.Value(r.Pattern),
		Method:    r.Method,
		Operation: op,
	}
	opts := &openapi3filter.Options{IncludeResponseStatus: true, MultiError: true}
	opts.WithCustomSchemaErrorFunc(schemaErrorMessage)
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{Request: req, Route: route},
		Status:                 status,
		Header:                 header,
		Options:                opts,
	}
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(req.Context(), in); err != nil {
		return fmt.Errorf("validate response: %w", err)
	}
	return nil
}

// schemaErrorMessage words a schema violation as where and why, leaving out
// the schema and value kin-openapi would print whole (a served document
// would fill the log).
func schemaErrorMessage(err *openapi3.SchemaError) string {
	return fmt.Sprintf("at /%s: %s", strings.Join(err.JSONPointer(), "/"), err.Reason)
}

// CheckAdminAuth probes the running service at baseURL (http://host:port),
// which must run with authentication required and token as its operator
// token, and fails the test unless every mutating route it serves (any
// method but GET, HEAD and OPTIONS) is secured in the document, and every
// secured operation answers 401 (problem+json, with a Bearer challenge)
// without a token and with a wrong one, and, with the operator token, runs
// when its security lists adminToken and answers 403 otherwise (a route
// of engines or services). Every answer must also be one the document
// declares for the operation (CheckResponse). Path parameters are filled
// from values ("1" when absent); requests have no body.
func CheckAdminAuth(t testing.TB, baseURL, token string, served []httpserver.Route, d *OpenAPI, values map[string]string) {
	t.Helper()
	for _, r := range served {
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			continue
		}
		if !d.Secured(r) {
			t.Errorf("%s mutates but is not secured", r)
		}
	}
	for _, r := range d.Routes() {
		if d.Secured(r) {
			d.checkSecured(t, r, baseURL+fillPath(r.Pattern, values), token)
		}
	}
}

// checkSecured probes one secured route with no, a wrong and the operator
// token.
func (d *OpenAPI) checkSecured(t testing.TB, r httpserver.Route, target, token string) {
	t.Helper()
	operator := 0 // the route runs
	if !d.schemes(r)["adminToken"] {
		operator = http.StatusForbidden
	}
	tests := []struct {
		name, auth string
		want       int
	}{
		{"missing token", "", http.StatusUnauthorized},
		{"wrong token", "Bearer wrong-" + token, http.StatusUnauthorized},
		{"operator token", "Bearer " + token, operator},
	}
	for _, tt := range tests {
		req, code, header, body := send(t, r.Method, target, tt.auth)
		d.CheckResponse(t, r, req, code, header, body)
		if tt.want == 0 {
			if code == http.StatusUnauthorized || code == http.StatusForbidden {
				t.Errorf("%s with the %s: %d %s, want the route to run", r, tt.name, code, clip(body))
			}
			continue
		}
		if code != tt.want || header.Get("Content-Type") != httpserver.ContentTypeProblem {
			t.Errorf("%s with a %s: %d %q %s, want %d problem+json", r, tt.name, code, header.Get("Content-Type"), clip(body), tt.want)
		}
		if tt.want == http.StatusUnauthorized && !strings.HasPrefix(header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("%s with a %s: WWW-Authenticate %q, want a Bearer challenge", r, tt.name, header.Get("WWW-Authenticate"))
		}
	}
}

// schemes are the security schemes the operation's requirements name.
func (d *OpenAPI) schemes(r httpserver.Route) map[string]bool {
	out := map[string]bool{}
	op := d.operations[r]
	if op == nil || op.Security == nil {
		return out
	}
	for _, req := range *op.Security {
		for name := range req {
			out[name] = true
		}
	}
	return out
}

// send makes one request without a body and returns it with the answer's
// status, header and body (at most maxProbeBody bytes).
func send(t testing.TB, method, target, auth string) (*http.Request, int, http.Header, []byte) {
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
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxProbeBody))
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, target, err)
	}
	return req, resp.StatusCode, resp.Header, b
}

// clip shortens a body for a failure message.
func clip(b []byte) string {
	const n = 512
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
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

// CheckServedOpenAPI fetches the document a running service serves at
// httpserver.PathOpenAPI from addr, fails unless it is embedded (the one the
// service embeds), checks it against the served routes with CheckOpenAPI,
// and validates with CheckResponse its own answer and the answer of every
// served GET route without path parameters (requested without a token, so
// a secured one must answer as documented for that).
func CheckServedOpenAPI(t testing.TB, addr string, served []httpserver.Route, embedded []byte) *OpenAPI {
	t.Helper()
	req, code, header, doc := send(t, http.MethodGet, "http://"+addr+httpserver.PathOpenAPI, "")
	if code != http.StatusOK || !bytes.Equal(doc, embedded) {
		t.Fatalf("GET %s: %d, %d bytes; want the embedded document", httpserver.PathOpenAPI, code, len(doc))
	}
	d := CheckOpenAPI(t, served, doc)
	d.CheckResponse(t, httpserver.Route{Method: http.MethodGet, Pattern: httpserver.PathOpenAPI}, req, code, header, doc)
	for _, r := range d.Routes() {
		if r.Method != http.MethodGet || r.Pattern == httpserver.PathOpenAPI || pathParam.MatchString(r.Pattern) || !slices.Contains(served, r) {
			continue
		}
		req, code, header, body := send(t, r.Method, "http://"+addr+r.Pattern, "")
		d.CheckResponse(t, r, req, code, header, body)
	}
	return d
}
