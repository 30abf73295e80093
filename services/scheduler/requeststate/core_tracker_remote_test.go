package requeststate

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestTrackerRemoteLoad: a pd tracker (Connector "pd", Remote set) copies
// its remote source into the load task without aliasing it, and prefixes
// its task ids so they never collide with the store tracker's.
func TestTrackerRemoteLoad(t *testing.T) {
	m := trkHybrid(t)
	store, pd := newTrk(m), newTrk(m)
	pd.Connector, pd.Consumer = "pd", true
	pd.Remote = &kvcore.RemoteSource{EngineID: "prefill-1", BlockTable: tbl(ids(40, 2), ids(60, 2))}
	for _, tr := range []*Tracker{store, pd} {
		noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 2), ids(8, 2))))
	}
	ls := noErr(t, store.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})).Loads
	lp := noErr(t, pd.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})).Loads
	if len(ls) != 1 || len(lp) != 1 {
		t.Fatalf("loads: store %d, pd %d; want 1 each", len(ls), len(lp))
	}
	if ls[0].TaskID != "e1/r1/load/1" || lp[0].TaskID != "e1/r1/pd-load/1" {
		t.Fatalf("task ids %q and %q", ls[0].TaskID, lp[0].TaskID)
	}
	if ls[0].Remote != nil || lp[0].Connector != "pd" || !reflect.DeepEqual(lp[0].Remote, pd.Remote) {
		t.Fatalf("remote: store %+v, pd %+v (%s)", ls[0].Remote, lp[0].Remote, lp[0].Connector)
	}
	pd.Remote.BlockTable[0][0] = 99
	if lp[0].Remote.BlockTable[0][0] != 40 {
		t.Fatal("the load task's remote table aliases the tracker's")
	}
	b, err := MarshalTracker(pd)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalTracker(b)
	if err != nil || !reflect.DeepEqual(back.Remote, pd.Remote) {
		t.Fatalf("round trip: %v, remote %+v", err, back.Remote)
	}
	var wire map[string]any
	if err := json.Unmarshal(mustJSON(t, lp[0]), &wire); err != nil || wire["remote"] == nil {
		t.Fatalf("load task JSON lacks remote: %v %v", err, wire)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
