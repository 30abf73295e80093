package api_test

import (
	"context"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/services/sender/internal/api"
	"github.com/kvmesh/kvmesh/services/sender/internal/removals"
)

// TestRemovalsRoute: GET /v1/removals answers, with the operator token
// only, what of a tenant left the store in the window, per cause; bad
// parameters are refused naming the parameter.
func TestRemovalsRoute(t *testing.T) {
	log := removals.New(dbtest.NewPool(t), 0)
	base := serve(t, api.New(&recordingSender{}, nil, nil, slog.New(slog.DiscardHandler)).WithRemovals(log))
	now := time.Now()
	group := 0
	rec := func(at time.Time, tenant, cause string, ages ...float64) contract.KVEventRecord {
		return contract.KVEventRecord{
			Batch: contract.KVEventBatch{TS: contract.UnixSeconds(at), Events: []contract.KVEvent{{Kind: contract.BlockRemoved, GroupIdx: &group}}},
			Model: "m", Fingerprint: "00112233445566ff", Tenant: tenant, Namespace: "dep@m@" + tenant, Cause: cause,
			Hashes: make([]string, len(ages)), Ages: ages,
		}
	}
	if err := log.Record(context.Background(), []contract.KVEventRecord{
		rec(now.Add(-2*time.Hour), "acme", "evicted", 10),
		rec(now.Add(-10*time.Minute), "acme", "evicted", 30, 90),
		rec(now.Add(-5*time.Minute), "globex", "expired", 5),
	}); err != nil {
		t.Fatal(err)
	}
	var got adminapi.Removals
	if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/removals?tenant=acme", token, &got); code != http.StatusOK {
		t.Fatalf("status %d, want 200", code)
	}
	if got.Tenant == nil || *got.Tenant != "acme" || len(got.ByCause) != 1 || got.ByCause[0].Blocks != 2 || *got.ByCause[0].AgeAvgS != 60 || len(got.Recent) != 1 {
		t.Fatalf("acme's last hour: %+v", got)
	}
	if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/removals?since=3h&cause=evicted", token, &got); code != http.StatusOK || got.ByCause[0].Blocks != 3 || len(got.Recent) != 2 {
		t.Fatalf("evictions of 3 h: %d %+v", code, got)
	}
	if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/removals", "", nil); code != http.StatusUnauthorized {
		t.Fatalf("without a token: %d, want 401", code)
	}
	for q, param := range map[string]string{
		"?tenant=a%20b": "tenant", "?cause=gone": "cause", "?since=yesterday": "since", "?since=-1h": "since",
		"?since=9999h": "since", "?limit=0": "limit",
	} {
		var p map[string]any
		if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/removals"+q, token, &p); code != http.StatusBadRequest || p["parameter"] != param {
			t.Errorf("%s: %d %v, want 400 naming %s", q, code, p, param)
		}
	}
}
