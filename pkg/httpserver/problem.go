package httpserver

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	"github.com/go-chi/chi/v5"
)

// ContentTypeProblem is the media type of RFC 9457 problem details.
const ContentTypeProblem = "application/problem+json"

// ContentTypeJSON is the media type of ordinary JSON responses.
const ContentTypeJSON = "application/json"

// Problem is an RFC 9457 problem details object. Extras are extension
// members written beside the standard ones (a standard member always wins
// over an extra of the same name).
type Problem struct {
	// Type is a URI naming the problem type; "about:blank" when empty.
	Type string
	// Title is a short summary of the problem type.
	Title string
	// Status is the HTTP status code.
	Status int
	// Detail explains this occurrence.
	Detail string
	// Instance identifies this occurrence; WriteProblem sets the request
	// path.
	Instance string
	// Extras holds extension members such as request_id or field.
	Extras map[string]any
}

// standard member names of a problem object.
var problemMembers = []string{"type", "title", "status", "detail", "instance"}

// MarshalJSON writes the standard members and the extras as one object.
func (p Problem) MarshalJSON() ([]byte, error) {
	m := make(map[string]any, len(p.Extras)+5)
	for k, v := range p.Extras {
		m[k] = v
	}
	typ := p.Type
	if typ == "" {
		typ = "about:blank"
	}
	m["type"] = typ
	m["title"] = p.Title
	m["status"] = p.Status
	delete(m, "detail")
	delete(m, "instance")
	if p.Detail != "" {
		m["detail"] = p.Detail
	}
	if p.Instance != "" {
		m["instance"] = p.Instance
	}
	return json.Marshal(m)
}

// UnmarshalJSON reads a problem object; unknown members go to Extras.
func (p *Problem) UnmarshalJSON(b []byte) error {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return fmt.Errorf("problem: %w", err)
	}
	var out Problem
	targets := []any{&out.Type, &out.Title, &out.Status, &out.Detail, &out.Instance}
	for i, name := range problemMembers {
		if v, ok := raw[name]; ok {
			if err := json.Unmarshal(v, targets[i]); err != nil {
				return fmt.Errorf("problem member %q: %w", name, err)
			}
			delete(raw, name)
		}
	}
	for k, v := range raw {
		var x any
		if err := json.Unmarshal(v, &x); err != nil {
			return fmt.Errorf("problem member %q: %w", k, err)
		}
		if out.Extras == nil {
			out.Extras = make(map[string]any, len(raw))
		}
		out.Extras[k] = x
	}
	*p = out
	return nil
}

// Error formats the problem, so a client can return a decoded Problem as an
// error.
func (p *Problem) Error() string {
	s := strconv.Itoa(p.Status) + " " + p.Title
	if p.Detail != "" {
		s += ": " + p.Detail
	}
	return s
}

// WriteProblem writes an application/problem+json response. An empty title
// becomes the status text; instance is the request path and the request id
// is added as the request_id extension member. r may be nil.
func WriteProblem(w http.ResponseWriter, r *http.Request, status int, title, detail string, extras map[string]any) {
	if title == "" {
		title = http.StatusText(status)
	}
	p := Problem{Title: title, Status: status, Detail: detail, Extras: extras}
	if r != nil {
		p.Instance = r.URL.Path
		if id := RequestID(r.Context()); id != "" {
			p.Extras = make(map[string]any, len(extras)+1)
			for k, v := range extras {
				p.Extras[k] = v
			}
			p.Extras["request_id"] = id
		}
	}
	body, err := json.Marshal(p)
	if err != nil {
		// An extra that cannot be encoded: keep the standard members.
		p.Extras = nil
		body, _ = json.Marshal(p) // strings and an int always encode
	}
	writeBody(w, status, ContentTypeProblem, body)
}

// WriteJSON writes v as a JSON response with the given status. When v cannot
// be encoded it writes a 500 problem instead and returns the encoding
// error; errors writing to the client are not reported (the client is gone
// and nothing can be done about it).
func WriteJSON(w http.ResponseWriter, status int, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		WriteProblem(w, nil, http.StatusInternalServerError, "", "the response could not be encoded", nil)
		return fmt.Errorf("httpserver: encode response: %w", err)
	}
	writeBody(w, status, ContentTypeJSON, body)
	return nil
}

func writeBody(w http.ResponseWriter, status int, contentType string, body []byte) {
	h := w.Header()
	h.Set("Content-Type", contentType)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Length", strconv.Itoa(len(body)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n')) // see WriteJSON: write errors are not actionable.
}

// notFound renders the router's 404 as a problem.
func notFound(w http.ResponseWriter, r *http.Request) {
	markUnmatched(r)
	WriteProblem(w, r, http.StatusNotFound, "", "no route for "+r.URL.Path, nil)
}

// routeMethods are the methods checked when building an Allow header.
var routeMethods = []string{
	http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
	http.MethodPatch, http.MethodDelete, http.MethodOptions,
}

// methodNotAllowed renders the router's 405 as a problem with an Allow
// header listing the methods the path does support.
func (s *Server) methodNotAllowed(w http.ResponseWriter, r *http.Request) {
	markUnmatched(r)
	path := r.URL.RawPath
	if path == "" {
		path = r.URL.Path
	}
	var allowed []string
	for _, m := range routeMethods {
		if s.mux.Match(chi.NewRouteContext(), m, path) {
			allowed = append(allowed, m)
			w.Header().Add("Allow", m)
		}
	}
	WriteProblem(w, r, http.StatusMethodNotAllowed, "",
		fmt.Sprintf("method %s is not allowed on %s", r.Method, r.URL.Path),
		map[string]any{"allowed_methods": allowed})
}
