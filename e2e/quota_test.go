package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

// quotaBytes is tenant q0's quota in TestTenantQuotaInTheMesh: a few
// blocks of the model, far less than its conversations save.
const quotaBytes = 1 << 20

// TestTenantQuotaInTheMesh plays two tenants through the whole mesh with a
// byte quota on q0 only (set through the sender's PUT /v1/quotas/q0), then
// replays the workload on a fresh engine. Both runs are clean: every
// loaded byte right, the ledger balanced, every stored value still in the
// store right — q0's blocks that its quota removed are misses, never wrong
// loads. The report, from the sender, shows q0 within its quota with
// blocks removed for cause quota, and q1 with no quota and nothing
// removed; the replay loads q1's prefixes from the store.
func TestTenantQuotaInTheMesh(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "store", poolBlocks: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	putQuota(t, s.url("sender")+"/v1/quotas/q0", `{"max_bytes": 1048576}`)
	first := simConfig(t, s, false, quotaWorkload())
	rep := runQuotaTenants(ctx, t, first)
	q0, q1 := rep.Tenants[0], rep.Tenants[1]
	if q := q0.Store.Quota; q == nil || q.UsageBytes > quotaBytes || q.EvictedBlocks == 0 || q0.Store.Removed["quota"] == 0 {
		t.Fatalf("tenant q0: %+v; want its usage within %d bytes and blocks removed for cause quota", q0.Store, quotaBytes)
	}
	if q1.Store.Quota != nil || len(q1.Store.Removed) != 0 || q1.StoredKeys == 0 {
		t.Fatalf("tenant q1: %+v, %d keys stored; want no quota, nothing removed", q1.Store, q1.StoredKeys)
	}

	replay := simConfig(t, s, false, quotaWorkload())
	replay.Salt = first.Salt
	again := runQuotaTenants(ctx, t, replay)
	if r1 := again.Tenants[1]; r1.FirstTurnStoreLoadedTokens == 0 || len(r1.Store.Removed) != 0 {
		t.Fatalf("replay of tenant q1: %d first-turn tokens loaded, removed %v; want its own saves loaded and none removed",
			r1.FirstTurnStoreLoadedTokens, r1.Store.Removed)
	}
}

// quotaWorkload is eight conversations of two turns, four per tenant,
// over four system prompts: each tenant saves several times its quota.
func quotaWorkload() sim.Workload {
	w := tenantWorkload("q")
	w.Requests, w.SystemPrompts = 16, 4
	return w
}

// runQuotaTenants runs cfg and requires a clean report with the sender's
// view of both tenants.
func runQuotaTenants(ctx context.Context, t *testing.T, cfg sim.Config) *sim.Report {
	t.Helper()
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if len(rep.Tenants) != 2 || rep.Tenants[0].Store == nil || rep.Tenants[1].Store == nil ||
		rep.Tenants[0].Store.Error != "" || rep.Tenants[1].Store.Error != "" {
		t.Fatalf("tenants %+v; want q0 and q1 with the sender's view of each", rep.Tenants)
	}
	return rep
}

// putQuota sets a quota as the operator and requires 200.
func putQuota(t *testing.T, url, body string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+adminToken)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var q adminapi.TenantQuota
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &q) != nil || q.MaxBytes != quotaBytes {
		t.Fatalf("PUT %s: %d %s", url, resp.StatusCode, b)
	}
}
