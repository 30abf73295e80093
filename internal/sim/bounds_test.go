package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// TestRetryIsBoundedInTime: retry gives up after its bound (not after a
// number of attempts), at once on a permanent error, and returns nil when
// the call recovers within the bound.
func TestRetryIsBoundedInTime(t *testing.T) {
	transient := fmt.Errorf("worker: %w", dataplane.ErrUnavailable)
	for name, tc := range map[string]struct {
		bound     time.Duration
		failFor   int // attempts that fail before success; -1 always
		err       error
		wantErr   bool
		wantCalls func(n int) bool
		minTook   time.Duration
	}{
		"recovers":       {bound: 5 * time.Second, failFor: 3, err: transient, wantCalls: func(n int) bool { return n == 4 }},
		"outage outlast": {bound: 300 * time.Millisecond, failFor: -1, err: transient, wantErr: true, wantCalls: func(n int) bool { return n >= 3 && n < 10 }, minTook: 300 * time.Millisecond},
		"rejected":       {bound: 5 * time.Second, failFor: -1, err: fmt.Errorf("bad: %w", dataplane.ErrRejected), wantErr: true, wantCalls: func(n int) bool { return n == 1 }},
	} {
		t.Run(name, func(t *testing.T) {
			calls := 0
			start := time.Now()
			err := retryFor(context.Background(), tc.bound, func() error {
				calls++
				if tc.failFor < 0 || calls <= tc.failFor {
					return tc.err
				}
				return nil
			})
			took := time.Since(start)
			if (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, tc.err)) {
				t.Fatalf("err %v, want error %v", err, tc.wantErr)
			}
			if !tc.wantCalls(calls) {
				t.Fatalf("%d calls", calls)
			}
			if took < tc.minTook || took > tc.bound+time.Second {
				t.Fatalf("took %v with bound %v", took, tc.bound)
			}
		})
	}
}

// TestLookupBackoff: failed lookups are retried with a doubling backoff
// capped at 1 s, until the timeout since the first failure.
func TestLookupBackoff(t *testing.T) {
	var r request
	t0 := time.Unix(1000, 0)
	now := t0
	var delays []time.Duration
	for r.lookupRetry(now, 4*time.Second) {
		delays = append(delays, r.lookupRetryAt.Sub(now))
		now = r.lookupRetryAt
	}
	want := []time.Duration{50, 100, 200, 400, 800, 1000, 1000, 450}
	if len(delays) != len(want) {
		t.Fatalf("delays %v, want %v ms", delays, want)
	}
	for i := range want {
		if delays[i] != want[i]*time.Millisecond {
			t.Fatalf("delay %d is %v; all %v", i, delays[i], delays)
		}
	}
	if now.Sub(t0) != 4*time.Second {
		t.Fatalf("gave up at %v, want at the 4 s timeout", now.Sub(t0))
	}
}

// lookupServer answers 503 until down passed, then a decision with no
// external tokens; it counts the calls.
func lookupServer(t *testing.T, down time.Duration) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var calls atomic.Int32
	start := time.Now()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		calls.Add(1)
		if time.Since(start) < down {
			http.Error(w, "restarting", http.StatusServiceUnavailable)
			return
		}
		_ = json.NewEncoder(w).Encode(contract.LookupDecision{DecisionID: "d"})
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}

// TestLookupOutageShorterThanTimeout: a lookup outage of well over 50
// engine steps (the old bound) but under the request timeout fails no
// request, and the backoff keeps the calls few; an outage past the timeout
// fails the request.
func TestLookupOutageShorterThanTimeout(t *testing.T) {
	for name, tc := range map[string]struct {
		down, timeout time.Duration
		wantFail      bool
	}{
		"restart":      {down: 700 * time.Millisecond, timeout: time.Minute},
		"past timeout": {down: time.Hour, timeout: 400 * time.Millisecond, wantFail: true},
	} {
		t.Run(name, func(t *testing.T) {
			srv, calls := lookupServer(t, tc.down)
			e, _ := testEngine(t, "hybrid-mla-linear", 16)
			e.timeout = tc.timeout
			e.lookup = newLookupClient([]string{srv.URL}, srv.Client())
			r := testRequest(e, "run-1", 40, 0)
			r.ctx = context.Background()
			deadline := time.Now().Add(10 * time.Second)
			steps := 0
			for {
				steps++
				if _, ok := e.ask(context.Background(), r, 40, 0); ok {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the lookup never went on")
				}
				time.Sleep(5 * time.Millisecond) // one engine step
			}
			if failed := r.failure != ""; failed != tc.wantFail {
				t.Fatalf("failure %q, want failed %v", r.failure, tc.wantFail)
			}
			if tc.wantFail && !strings.Contains(r.failure, "lookup unavailable") {
				t.Fatalf("failure %q", r.failure)
			}
			if !tc.wantFail && (steps <= 50 || calls.Load() > 15) {
				t.Fatalf("%d steps, %d lookups: the outage must outlast 50 steps and the backoff keep calls few", steps, calls.Load())
			}
		})
	}
}
