package requeststate

import (
	"bytes"
	"encoding/json"
	"testing"
)

// storedRow is a tracker row as the ledger wrote it before the stored form
// had its own struct: every field set, in field order.
const storedRow = `{"engine_id":"e1","request_id":"r1","model":"m","tenant":"t1","connector":"pd",` +
	`"remote":{"engine_id":"p0","block_table":[[1,2]]},"consumer":true,"state":"finishing","error":"x",` +
	`"token_len":64,"prefill_end":48,"prompt_tokens":40,"tail_saved":true,"block_table":[[1,2,3],[4,null]],` +
	`"num_saved_tokens":32,"save_spans":[{"task_id":"s1","start":0,"end":32,"job":1,"covered_low":16,"covered_high":8}],` +
	`"unsaved":[{"task_id":"s0","start":0,"end":16}],"save_jobs":2,"block_hashes":["aa","bb"],"token_ids":[1,2],` +
	`"lora_name":"sql","load":{"looked_up":true,"spec":{"vllm_cached_tokens":0,"kvpool_cached_tokens":32,"can_load":true},` +
	`"allocated":true,"external_tokens":32,"block_table":[[7]],"resolved":true,"issued":true,"pending_seen":true},` +
	`"seq":5,"epoch":1,"pending_saves":["s1"],"pending_loads":["l1"],"stale_saves":["s0"],"stale_loads":["l0"],` +
	`"load_waits":[{"task_id":"l1","waiting":[{"tp":1,"pcp":0,"dcp":0,"pp":0}],"errors":[3],"blocks":[3,4],"deadline":"2026-01-02T03:04:05Z"}],` +
	`"save_reports":{"stored":1,"skipped":2,"dead_lettered":3,"failed":4}}`

// TestStoredFormUnchanged decodes a row written before the stored form was
// split from the tracker and encodes it back byte for byte, extras too.
func TestStoredFormUnchanged(t *testing.T) {
	tr, err := UnmarshalTracker([]byte(storedRow))
	if err != nil {
		t.Fatal(err)
	}
	if tr.State != StateFinishing || tr.Load.Spec == nil || !tr.Load.Spec.CanLoad || len(tr.LoadWaits) != 1 || tr.LoadWaits[0].Deadline.IsZero() {
		t.Fatalf("decoded %+v", tr)
	}
	b, err := MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	if err := json.Compact(&want, []byte(storedRow)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, want.Bytes()) {
		t.Fatalf("re-encoded\n%s\nwant\n%s", b, want.Bytes())
	}
	extras := `{"pd":` + storedRow + `,"awaiting_decision":"d1","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`
	x, err := UnmarshalExtras([]byte(extras))
	if err != nil || x.PD == nil || x.Awaiting != "d1" {
		t.Fatalf("extras %+v %v", x, err)
	}
	xb, err := MarshalExtras(x)
	if err != nil || string(xb) != extras {
		t.Fatalf("extras re-encoded %s %v\nwant %s", xb, err, extras)
	}
	waits, err := UnmarshalLoadWaits([]byte(`[{"task_id":"l1","waiting":[],"blocks":[3]}]`))
	if err != nil || len(waits) != 1 || waits[0].TaskID != "l1" {
		t.Fatalf("load waits %+v %v", waits, err)
	}
}
