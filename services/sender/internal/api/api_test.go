package api_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/services/sender/internal/api"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const token = "api-test-token"

// serve mounts the API on a real httpserver behind httptest.
func serve(t *testing.T, a *api.API) string {
	t.Helper()
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0", AdminToken: token})
	if err != nil {
		t.Fatal(err)
	}
	a.Mount(srv.Router(), srv.RequireAdmin())
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return ts.URL
}

// recordingSender is the sending side for tests of request handling: it
// records which method a request reached.
type recordingSender struct {
	mu    sync.Mutex
	calls []string
}

func (s *recordingSender) Replay(_ context.Context, id int64) (deadletter.Replayed, error) {
	s.record("replay")
	if id == 404 {
		return deadletter.Replayed{}, deadletter.ErrNotFound
	}
	return deadletter.Replayed{DeadLetter: deadletter.DeadLetter{ID: id, ReplayStatus: deadletter.ReplayDone, ReplayCount: 1},
		Result: deadletter.ReplayResult{Status: "stored"}}, nil
}

func (s *recordingSender) DryRun(_ context.Context, id int64) (sending.DryRun, error) {
	s.record("dry_run")
	if id == 404 {
		return sending.DryRun{}, deadletter.ErrNotFound
	}
	g := 1
	return sending.DryRun{DeadLetter: deadletter.DeadLetter{ID: id, ReplayStatus: deadletter.ReplayNone}, DryRun: adminapi.DryRun{
		Expect: sending.ExpectInvalid, Reason: "table_group_count", Group: &g}}, nil
}

func (s *recordingSender) Pressure() sending.PressureState { return sending.PressureState{} }

func (s *recordingSender) record(c string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = append(s.calls, c)
}

func (s *recordingSender) last() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.calls) == 0 {
		return ""
	}
	return s.calls[len(s.calls)-1]
}

func TestReplayDryRunParameter(t *testing.T) {
	s := &recordingSender{}
	base := serve(t, api.New(s, nil, nil, slog.New(slog.DiscardHandler)))
	tests := []struct {
		query    string
		id       string
		wantCode int
		wantCall string
		check    func(t *testing.T, body map[string]any)
	}{
		{"", "7", 200, "replay", func(t *testing.T, b map[string]any) {
			if b["replay_status"] != "replayed" || b["dry_run"] != nil {
				t.Errorf("replay answer %v", b)
			}
		}},
		{"?dry_run=false", "7", 200, "replay", nil},
		{"?dry_run=true", "7", 200, "dry_run", func(t *testing.T, b map[string]any) {
			if b["dry_run"] != true || b["replayable"] != false || b["expect"] != "invalid" ||
				b["reason"] != "table_group_count" || b["group"] != 1.0 || b["id"] != 7.0 || b["replay_status"] != "none" {
				t.Errorf("dry-run answer %v", b)
			}
		}},
		{"?dry_run=1", "404", 404, "dry_run", nil},
		{"?dry_run=maybe", "7", 400, "", func(t *testing.T, b map[string]any) {
			if b["parameter"] != "dry_run" {
				t.Errorf("problem %v does not name dry_run", b)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.query, func(t *testing.T) {
			before := len(s.calls)
			var body map[string]any
			code := testenv.CallJSON(t, http.MethodPost, base+"/v1/dlq/"+tt.id+"/replay"+tt.query, token, &body)
			if code != tt.wantCode {
				t.Fatalf("%d %v, want %d", code, body, tt.wantCode)
			}
			if got := s.last(); tt.wantCall != "" && (got != tt.wantCall || len(s.calls) != before+1) || tt.wantCall == "" && len(s.calls) != before {
				t.Fatalf("reached %q (calls %v), want %q", got, s.calls, tt.wantCall)
			}
			if tt.check != nil {
				tt.check(t, body)
			}
		})
	}
}
