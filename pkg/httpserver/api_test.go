package httpserver_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

type echoRequest struct {
	Name  string `json:"name"`
	Count int    `json:"count"`
	Inner struct {
		Flag bool `json:"flag"`
	} `json:"inner"`
}

func mountEcho(s *httpserver.Server) {
	echo := func(w http.ResponseWriter, r *http.Request) {
		var req echoRequest
		if err := httpserver.DecodeJSON(w, r, &req); err != nil {
			return
		}
		_ = httpserver.WriteJSON(w, http.StatusOK, req)
	}
	s.Router().Post("/v1/echo", echo)
	s.Router().With(httpserver.BodyLimit(1<<16)).Post("/v1/big", echo)
}

func TestDecodeJSON(t *testing.T) {
	ts := start(t, httpserver.Options{MaxBodyBytes: 128}, mountEcho)
	long := `{"name":"` + strings.Repeat("x", 300) + `"}`
	tests := []struct {
		name        string
		path, body  string
		contentType string
		wantStatus  int
		wantDetail  string
		wantField   string
	}{
		{"valid", "/v1/echo", `{"name":"a","count":2,"inner":{"flag":true}}`, "application/json", 200, "", ""},
		{"json with charset", "/v1/echo", `{"name":"a"}`, "application/json; charset=utf-8", 200, "", ""},
		{"unknown field", "/v1/echo", `{"name":"a","colour":"red"}`, "", 400, `unknown field "colour"`, "colour"},
		{"wrong type", "/v1/echo", `{"count":"two"}`, "", 400, `field "count" must be a JSON integer, got string`, "count"},
		{"wrong nested type", "/v1/echo", `{"inner":{"flag":1}}`, "", 400, `field "inner.flag" must be a JSON boolean, got number`, "inner.flag"},
		{"not an object", "/v1/echo", `[1,2]`, "", 400, "must be a JSON object, got array", ""},
		{"two values", "/v1/echo", `{"name":"a"} {"name":"b"}`, "", 400, "single JSON value", ""},
		{"trailing garbage", "/v1/echo", `{"name":"a"} x`, "", 400, "single JSON value", ""},
		{"empty", "/v1/echo", "", "", 400, "empty", ""},
		{"truncated", "/v1/echo", `{"name":`, "", 400, "malformed JSON", ""},
		{"syntax error", "/v1/echo", `{"name" "a"}`, "", 400, "malformed JSON at byte offset", ""},
		{"wrong media type", "/v1/echo", `{}`, "text/plain", 415, `"text/plain"`, ""},
		{"too large", "/v1/echo", long, "", 413, "exceeds 128 bytes", ""},
		{"route with a larger limit", "/v1/big", long, "", 200, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hdr := map[string]string{}
			if tt.contentType != "" {
				hdr["Content-Type"] = tt.contentType
			}
			res := ts.do(t, http.MethodPost, tt.path, tt.body, hdr)
			if tt.wantStatus == http.StatusOK {
				if res.status != http.StatusOK {
					t.Fatalf("status %d body %s, want 200", res.status, res.body)
				}
				return
			}
			p := res.problem(t, tt.wantStatus)
			if !strings.Contains(p.Detail, tt.wantDetail) {
				t.Errorf("detail %q does not contain %q", p.Detail, tt.wantDetail)
			}
			if field, _ := p.Extras["field"].(string); field != tt.wantField {
				t.Errorf("field extra = %q, want %q", field, tt.wantField)
			}
		})
	}
}

func TestDecodeJSONReturnsSentinels(t *testing.T) {
	tests := []struct {
		body        string
		contentType string
		want        error
	}{
		{`{"nope":1}`, "", httpserver.ErrInvalidJSON},
		{`{}`, "text/csv", httpserver.ErrUnsupportedMediaType},
		{`{"name":"` + strings.Repeat("y", int(httpserver.DefaultMaxBodyBytes)) + `"}`, "", httpserver.ErrBodyTooLarge},
	}
	for _, tt := range tests {
		// Outside the server's middleware: DecodeJSON applies the default limit itself.
		r := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader(tt.body))
		if tt.contentType != "" {
			r.Header.Set("Content-Type", tt.contentType)
		}
		var dst echoRequest
		if err := httpserver.DecodeJSON(httptest.NewRecorder(), r, &dst); !errors.Is(err, tt.want) {
			t.Errorf("DecodeJSON(%.20q) = %v, want %v", tt.body, err, tt.want)
		}
	}
}

func TestRequireAdmin(t *testing.T) {
	mount := func(s *httpserver.Server) {
		s.Router().With(s.RequireAdmin()).Post("/v1/admin", func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusNoContent)
		})
	}
	withToken := start(t, httpserver.Options{AdminToken: "s3cret"}, mount)
	noToken := start(t, httpserver.Options{}, mount)
	tests := []struct {
		name       string
		ts         *testServer
		auth       string
		wantStatus int
		wantDetail string
	}{
		{"missing header", withToken, "", 401, "Bearer"},
		{"other scheme", withToken, "Basic czNjcmV0", 401, "Bearer"},
		{"empty bearer", withToken, "Bearer ", 401, "Bearer"},
		{"wrong token", withToken, "Bearer guess", 401, "not valid"},
		{"token prefix", withToken, "Bearer s3cre", 401, "not valid"},
		{"right token", withToken, "Bearer s3cret", 204, ""},
		{"scheme case-insensitive", withToken, "bearer s3cret", 204, ""},
		{"no token configured", noToken, "Bearer anything", 403, "KVMESH_ADMIN_TOKEN is not set"},
		{"no token configured, no header", noToken, "", 403, "KVMESH_ADMIN_TOKEN is not set"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hdr := map[string]string{}
			if tt.auth != "" {
				hdr["Authorization"] = tt.auth
			}
			res := tt.ts.do(t, http.MethodPost, "/v1/admin", "", hdr)
			if tt.wantStatus == http.StatusNoContent {
				if res.status != http.StatusNoContent {
					t.Fatalf("status %d body %s, want 204", res.status, res.body)
				}
				return
			}
			p := res.problem(t, tt.wantStatus)
			if !strings.Contains(p.Detail, tt.wantDetail) {
				t.Errorf("detail %q does not contain %q", p.Detail, tt.wantDetail)
			}
			challenge := res.header.Get("WWW-Authenticate")
			if (tt.wantStatus == http.StatusUnauthorized) != strings.HasPrefix(challenge, "Bearer") {
				t.Errorf("WWW-Authenticate = %q for status %d", challenge, tt.wantStatus)
			}
		})
	}
}

func TestProblemJSONRoundTrip(t *testing.T) {
	p := httpserver.Problem{
		Title: "Conflict", Status: 409, Detail: "already replayed",
		Extras: map[string]any{"dlq_id": "7", "status": "ignored", "type": "ignored"},
	}
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var got httpserver.Problem
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.Type != "about:blank" || got.Status != 409 || got.Title != "Conflict" ||
		got.Detail != "already replayed" || got.Extras["dlq_id"] != "7" || len(got.Extras) != 1 {
		t.Fatalf("round trip of %s = %+v: standard members must win over extras", b, got)
	}
	if msg := got.Error(); msg != "409 Conflict: already replayed" {
		t.Fatalf("Error() = %q", msg)
	}
}

func TestWriteProblemDefaultsTitle(t *testing.T) {
	rec := httptest.NewRecorder()
	httpserver.WriteProblem(rec, httptest.NewRequest(http.MethodGet, "/v1/x", nil), http.StatusConflict, "", "busy",
		map[string]any{"retry": true})
	var p httpserver.Problem
	if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil {
		t.Fatal(err)
	}
	if rec.Code != 409 || rec.Header().Get("Content-Type") != httpserver.ContentTypeProblem ||
		p.Title != "Conflict" || p.Instance != "/v1/x" || p.Extras["retry"] != true {
		t.Fatalf("WriteProblem wrote %d %s", rec.Code, rec.Body.String())
	}
}

func TestWriteJSONEncodingFailure(t *testing.T) {
	rec := httptest.NewRecorder()
	err := httpserver.WriteJSON(rec, http.StatusOK, map[string]any{"ch": make(chan int)})
	if err == nil || rec.Code != http.StatusInternalServerError ||
		rec.Header().Get("Content-Type") != httpserver.ContentTypeProblem {
		t.Fatalf("WriteJSON(chan) = %v, response %d %q; want error and a 500 problem",
			err, rec.Code, rec.Header().Get("Content-Type"))
	}
}
