package api

import (
	"encoding/json"
	"testing"

	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestAPITrackerJSONIsTheStoredJSON checks that the admin API's answer for
// a tracker is byte for byte the tracker's stored JSON, so the split of
// the two forms changed no answer.
func TestAPITrackerJSONIsTheStoredJSON(t *testing.T) {
	row := `{"engine_id":"e1","request_id":"r1","model":"m","state":"running","token_len":64,` +
		`"block_table":[[1,2],[3,null]],"num_saved_tokens":32,"save_spans":[{"task_id":"s1","start":0,"end":32,"job":1}],` +
		`"load":{"looked_up":true,"spec":{"vllm_cached_tokens":0,"kvpool_cached_tokens":32,"can_load":false}},"seq":2,` +
		`"load_waits":[{"task_id":"l1","waiting":[{"tp":1,"pcp":0,"dcp":0,"pp":0}],"blocks":[3]}],` +
		`"save_reports":{"stored":1,"skipped":0,"dead_lettered":0,"failed":0}}`
	tr, err := requeststate.UnmarshalTracker([]byte(row))
	if err != nil {
		t.Fatal(err)
	}
	stored, err := requeststate.MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	answer, err := json.Marshal(toAPITracker(tr))
	if err != nil {
		t.Fatal(err)
	}
	if string(answer) != string(stored) || string(stored) != row {
		t.Fatalf("API answer\n%s\nstored\n%s\nrow\n%s", answer, stored, row)
	}
	if toAPITracker(nil) != nil {
		t.Fatal("nil tracker answered")
	}
	zero := &requeststate.Tracker{}
	zb, _ := json.Marshal(toAPITracker(zero))
	if zs, _ := requeststate.MarshalTracker(zero); string(zb) != string(zs) {
		t.Fatalf("zero tracker: API %s, stored %s", zb, zs)
	}
}
