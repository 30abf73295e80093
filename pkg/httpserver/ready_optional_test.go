package httpserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// TestReadyzOptionalCheck: a failed Optional check is named in the body's
// degraded list and checks, and keeps the service ready (200); a failed
// required check still answers 503, with the degraded list beside it.
func TestReadyzOptionalCheck(t *testing.T) {
	down := httpserver.ReadyCheck{Name: "store", Optional: true, Check: func(context.Context) error { return errors.New("connection refused") }}
	up := httpserver.ReadyCheck{Name: "store", Optional: true, Check: func(context.Context) error { return nil }}
	kafka := httpserver.ReadyCheck{Name: "kafka", Check: func(context.Context) error { return nil }}
	kafkaDown := httpserver.ReadyCheck{Name: "kafka", Check: func(context.Context) error { return errors.New("no brokers") }}
	cases := []struct {
		name         string
		checks       []httpserver.ReadyCheck
		wantStatus   int
		wantDegraded []string
	}{
		{"optional down", []httpserver.ReadyCheck{down, kafka}, http.StatusOK, []string{"store"}},
		{"optional up", []httpserver.ReadyCheck{up, kafka}, http.StatusOK, nil},
		{"optional and required down", []httpserver.ReadyCheck{down, kafkaDown}, http.StatusServiceUnavailable, []string{"store"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ts := start(t, httpserver.Options{Ready: tc.checks, ReadyTimeout: 50 * time.Millisecond}, nil)
			res := ts.do(t, http.MethodGet, "/readyz", "", nil)
			var body struct {
				Degraded []string                          `json:"degraded"`
				Failed   []string                          `json:"failed"`
				Checks   map[string]httpserver.CheckResult `json:"checks"`
			}
			if err := json.Unmarshal(res.body, &body); err != nil || res.status != tc.wantStatus {
				t.Fatalf("GET /readyz = %d %s (%v), want %d", res.status, res.body, err, tc.wantStatus)
			}
			if !slices.Equal(body.Degraded, tc.wantDegraded) {
				t.Fatalf("degraded %v, want %v: %s", body.Degraded, tc.wantDegraded, res.body)
			}
			if st := body.Checks["store"]; (st.Status == httpserver.StatusFailed) != (tc.wantDegraded != nil) {
				t.Fatalf("store check %+v", st)
			}
			if tc.wantStatus == http.StatusServiceUnavailable && !slices.Equal(body.Failed, []string{"kafka"}) {
				t.Fatalf("failed %v, want [kafka]", body.Failed)
			}
		})
	}
}
