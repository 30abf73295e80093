package intake

import (
	stdjson "encoding/json"
	"reflect"
	"testing"

	"github.com/segmentio/encoding/json"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// Step records are decoded with github.com/segmentio/encoding/json (three
// times encoding/json's speed on hash chains); it must read every record
// as encoding/json does, and refuse what it refuses.
func FuzzStepDecodeMatchesEncodingJSON(f *testing.F) {
	for _, s := range []string{
		`{"schema":"kvmesh.engine_step.v1","step_id":"e/1","engine_id":"e","model":"m","step":1,"requests":[{"request_id":"r","seq":1,"kind":"admitted","prompt_tokens":32,"block_hashes":["ab","cd"],"token_ids":[1,2]}]}`,
		`{"schema":"s","step_id":"e/1","engine_id":"e","null_block_id":0,"requests":[{"request_id":"r","seq":2,"kind":"allocated","block_table":[[0,1,null],[2]],"decision_id":"d"},{"request_id":"r","seq":3,"kind":"scheduled","step":{"kind":"new","tokens":16,"block_table":[[1]],"block_hashes":["ef"]}}]}`,
		`{"STEP_ID":"x","Requests":[{"Request_Id":"r","seq":1.0}]}`,
		`{"step_id":"\ud800x","requests":[{"request_id":"\xff","seq":1}]}`,
		`{"step_id":"a","step_id":"b","requests":null}`,
		`{"requests":[{"step":{"block_table":[[1e2]]}}]}`,
		`{"requests":[{"seq":9223372036854775808}]}`,
		`{"requests":[{"token_ids":[-1]}]}`,
		`[]`, `null`, `{}`, `{"requests":[{}]} x`, `{"step":"1"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want, got contract.EngineStep
		werr := stdjson.Unmarshal(b, &want)
		gerr := json.Unmarshal(b, &got)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("%q: segmentio error %v, encoding/json error %v", b, gerr, werr)
		}
		if werr == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: segmentio %+v, encoding/json %+v", b, got, want)
		}
	})
}
