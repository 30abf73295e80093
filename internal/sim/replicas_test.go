package sim

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// replicaServer answers every call with status (and, for 200, body) and
// counts the calls.
func replicaServer(t *testing.T, status int, body any) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		calls.Add(1)
		if status != http.StatusOK {
			http.Error(w, "replica says no", status)
			return
		}
		_ = json.NewEncoder(w).Encode(body)
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}

// closedURL is the base URL of a server that is gone: connections to it
// are refused.
func closedURL(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	return srv.URL
}

// TestLookupFailsOver: a lookup whose first replica is gone (connection
// refused) or answers 5xx is answered by the next replica within the same
// call, and later calls go straight to the replica that answered; a 4xx is
// not failed over; every replica down is ErrLookupUnavailable.
func TestLookupFailsOver(t *testing.T) {
	ctx := context.Background()
	req := lookupRequest{EngineID: "e", RequestID: "r", Model: "m"}
	good, goodCalls := replicaServer(t, http.StatusOK, contract.LookupDecision{DecisionID: "d"})
	failing, failingCalls := replicaServer(t, http.StatusBadGateway, nil)
	rejecting, rejectingCalls := replicaServer(t, http.StatusBadRequest, nil)

	c := newLookupClient([]string{closedURL(t), good.URL}, good.Client())
	for range 3 {
		d, err := c.lookup(ctx, req)
		if err != nil || d.DecisionID != "d" {
			t.Fatalf("closed, good: %v, %+v", err, d)
		}
	}
	if n := goodCalls.Load(); n != 3 {
		t.Fatalf("the good replica answered %d of 3 lookups", n)
	}

	c = newLookupClient([]string{failing.URL, good.URL}, good.Client())
	for range 3 {
		if _, err := c.lookup(ctx, req); err != nil {
			t.Fatalf("5xx, good: %v", err)
		}
	}
	if n := failingCalls.Load(); n != 1 {
		t.Fatalf("the 5xx replica was asked %d times: after it failed once the answering replica goes first", n)
	}

	c = newLookupClient([]string{rejecting.URL, good.URL}, good.Client())
	before := goodCalls.Load()
	if _, err := c.lookup(ctx, req); !errors.Is(err, ErrLookupRejected) || goodCalls.Load() != before || rejectingCalls.Load() != 1 {
		t.Fatalf("4xx: err %v, good asked %d times: a rejection is the answer, not a reason to fail over", err, goodCalls.Load()-before)
	}

	c = newLookupClient([]string{closedURL(t), failing.URL}, good.Client())
	if _, err := c.lookup(ctx, req); !errors.Is(err, ErrLookupUnavailable) {
		t.Fatalf("every replica down: %v, want ErrLookupUnavailable", err)
	}
}

// TestAdminChecksFailOver: the tracker and DLQ checks read from the next
// replica when the first is gone or answers 5xx.
func TestAdminChecksFailOver(t *testing.T) {
	ctx := context.Background()
	sched, schedCalls := replicaServer(t, http.StatusOK, map[string]any{"items": []trackerSummary{
		{EngineID: "e", RequestID: "run-1", State: "done"}, {EngineID: "e", RequestID: "other", State: "running"},
	}})
	tc := checkTrackers(ctx, sched.Client(), newReplicas([]string{closedURL(t), sched.URL}), []string{"e"}, "run-", 1)
	if !tc.OK || tc.Checked != 1 || tc.Error != "" || schedCalls.Load() != 1 {
		t.Fatalf("trackers with the first replica gone: %+v (%d calls)", tc, schedCalls.Load())
	}
	failing, _ := replicaServer(t, http.StatusServiceUnavailable, nil)
	sender, _ := replicaServer(t, http.StatusOK, map[string]any{"items": []deadLetter{{Reason: "x", RequestID: "run-1", EngineID: "e"}}})
	dc := checkDLQ(ctx, sender.Client(), newReplicas([]string{failing.URL, sender.URL}), []string{"e"}, "run-", []string{"e/run-1"})
	if !dc.OK || dc.Entries != 1 || dc.Error != "" {
		t.Fatalf("DLQ with the first replica answering 503: %+v", dc)
	}
	bad := checkTrackers(ctx, sched.Client(), newReplicas([]string{closedURL(t), failing.URL}), []string{"e"}, "run-", 1)
	if bad.OK || bad.Error == "" {
		t.Fatalf("every scheduler replica down: %+v, want an error", bad)
	}
}

func TestReplicaURLs(t *testing.T) {
	got := replicaURLs(" http://a:1/, http://b:2,,http://a:1", []string{"http://c:3", "http://b:2"})
	if want := []string{"http://a:1", "http://b:2", "http://c:3"}; !slices.Equal(got, want) {
		t.Fatalf("replicaURLs: %q, want %q", got, want)
	}
	if got := replicaURLs("", nil); len(got) != 0 {
		t.Fatalf("no URLs: %q", got)
	}
}
