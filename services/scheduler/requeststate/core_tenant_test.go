package requeststate

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestTrackerTasksCarryTenant: the tenant a tracker was admitted with is on
// every save and load task it emits.
func TestTrackerTasksCarryTenant(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	tr := NewTracker(m, "e1", "r1")
	tr.Tenant = "acme"
	tr.OnAdmit(trkHashes(8), 128)
	tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32})
	tr.OnAllocate(m, 32, kvcore.BlockTable{{1, 2, 3, 4, 5, 6, 7, 8}})
	eff := tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: kvcore.BlockTable{{1, 2, 3, 4, 5, 6, 7, 8}}})
	if len(eff.Loads) != 1 || eff.Loads[0].Tenant != "acme" {
		t.Fatalf("loads %+v: want one of tenant acme", eff.Loads)
	}
	tr.OnLoadResult(eff.Loads[0].TaskID, nil)
	eff = tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 128})
	if len(eff.Saves) == 0 {
		t.Fatalf("no save emitted: %+v", eff)
	}
	for _, s := range eff.Saves {
		if s.Tenant != "acme" {
			t.Fatalf("save %s has tenant %q, want acme", s.TaskID, s.Tenant)
		}
	}
	b, err := MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalTracker(b)
	if err != nil || back.Tenant != "acme" {
		t.Fatalf("tracker round trip: tenant %q, %v", back.Tenant, err)
	}
}
