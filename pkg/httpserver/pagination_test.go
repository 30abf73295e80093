package httpserver_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

type testCursor struct {
	Name string `json:"n"`
	Seq  int    `json:"s"`
}

func TestCursorRoundTrip(t *testing.T) {
	in := testCursor{Name: "engine/ä", Seq: 42}
	s := httpserver.EncodeCursor(in)
	if strings.ContainsAny(s, "+/=") {
		t.Fatalf("cursor %q is not URL-safe", s)
	}
	var out testCursor
	if err := httpserver.DecodeCursor(s, &out); err != nil || out != in {
		t.Fatalf("DecodeCursor(%q) = %+v, %v; want %+v", s, out, err, in)
	}
	for _, bad := range []string{"%%%", httpserver.EncodeCursor(map[string]int{"other": 1}), "eyJuIjoiYSJ9eA", httpserver.EncodeCursor("text")} {
		if err := httpserver.DecodeCursor(bad, &out); !errors.Is(err, httpserver.ErrBadCursor) {
			t.Errorf("DecodeCursor(%q) = %v, want ErrBadCursor", bad, err)
		}
	}
}

func TestPageParameters(t *testing.T) {
	good := httpserver.EncodeCursor(testCursor{Name: "x", Seq: 1})
	tests := []struct {
		query       string
		wantLimit   int
		wantCursor  bool
		wantBadName string
	}{
		{"", httpserver.DefaultPageLimit, false, ""},
		{"limit=1", 1, false, ""},
		{"limit=1000&cursor=" + good, 1000, true, ""},
		{"limit=0", 0, false, "limit"},
		{"limit=1001", 0, false, "limit"},
		{"limit=ten", 0, false, "limit"},
		{"cursor=not-ours", httpserver.DefaultPageLimit, true, "cursor"},
	}
	for _, tt := range tests {
		t.Run(tt.query, func(t *testing.T) {
			rec := httptest.NewRecorder()
			r := httptest.NewRequest(http.MethodGet, "/v1/list?"+tt.query, nil)
			limit, ok := httpserver.PageLimit(rec, r)
			var c testCursor
			present := false
			if ok {
				present, ok = httpserver.PageCursor(rec, r, &c)
			}
			if tt.wantBadName == "" {
				if !ok || limit != tt.wantLimit || present != tt.wantCursor || (present && c.Seq != 1) {
					t.Fatalf("limit %d ok %v cursor %v %+v; want limit %d cursor %v", limit, ok, present, c, tt.wantLimit, tt.wantCursor)
				}
				return
			}
			body := rec.Body.String()
			if ok || rec.Code != http.StatusBadRequest || !strings.Contains(body, fmt.Sprintf(`"parameter":%q`, tt.wantBadName)) {
				t.Fatalf("ok %v, %d %s; want a 400 naming %s", ok, rec.Code, body, tt.wantBadName)
			}
		})
	}
}
