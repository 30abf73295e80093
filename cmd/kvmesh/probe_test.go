package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestProbe(t *testing.T) {
	quiet(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/readyz":
			w.WriteHeader(http.StatusOK)
		case "/created":
			w.WriteHeader(http.StatusNoContent)
		default:
			http.Error(w, "postgres: not migrated", http.StatusServiceUnavailable)
		}
	}))
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close()
	t.Cleanup(srv.Close)

	for _, tc := range []struct {
		name    string
		args    []string
		wantErr error
		detail  string
	}{
		{name: "ready", args: []string{srv.URL + "/readyz"}},
		{name: "2xx", args: []string{"-timeout", "1s", srv.URL + "/created"}},
		{name: "not ready", args: []string{srv.URL + "/broken"}, wantErr: errProbeFailed, detail: "not migrated"},
		{name: "nothing listening", args: []string{closed.URL + "/readyz"}, detail: "connect"},
		{name: "no url", args: nil, wantErr: errUsage},
		{name: "two urls", args: []string{srv.URL, srv.URL}, wantErr: errUsage},
		{name: "not http", args: []string{"ftp://example.invalid/x"}, wantErr: errUsage},
		{name: "zero timeout", args: []string{"-timeout", "0s", srv.URL}, wantErr: errUsage},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := dispatch(context.Background(), append([]string{"probe"}, tc.args...))
			if tc.wantErr == nil && tc.detail == "" {
				if err != nil {
					t.Fatalf("probe failed: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("probe succeeded")
			}
			if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("error %v, want %v", err, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.detail) {
				t.Errorf("error %q does not mention %q", err, tc.detail)
			}
			if code := exitCode(err); code == 0 {
				t.Errorf("exit code 0 for %v", err)
			}
		})
	}
}
