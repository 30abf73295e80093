package contract_test

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestEngineStepNullBlockID decodes the engine's null-block declaration:
// vLLM's 0, an explicit JSON null and no declaration at all (the default:
// null blocks are JSON null), and the table as sent, before intake
// normalises it.
func TestEngineStepNullBlockID(t *testing.T) {
	zero := int64(0)
	cases := []struct {
		name     string
		field    string
		want     *int64
		wantNull kvcore.BlockID
		table    kvcore.BlockTable // after kvcore.BlockTable.NormalizeNull
	}{
		{"vLLM null id 0", `"null_block_id":0,`, &zero, 0, kvcore.BlockTable{{kvcore.NullBlock, 3, kvcore.NullBlock}}},
		{"JSON null", `"null_block_id":null,`, nil, kvcore.NullBlock, kvcore.BlockTable{{0, 3, kvcore.NullBlock}}},
		{"absent", ``, nil, kvcore.NullBlock, kvcore.BlockTable{{0, 3, kvcore.NullBlock}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			raw := `{"schema":"kvmesh.engine_step.v1","step_id":"e/1","engine_id":"e","model":"m","step":1,` + tc.field +
				`"requests":[{"request_id":"r","seq":1,"kind":"allocated","block_table":[[0,3,null]]}]}`
			var st contract.EngineStep
			if err := json.Unmarshal([]byte(raw), &st); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(st.NullBlockID, tc.want) {
				t.Fatalf("NullBlockID %v, want %v", st.NullBlockID, tc.want)
			}
			null := kvcore.EngineNullBlock(st.NullBlockID)
			if null != tc.wantNull {
				t.Fatalf("EngineNullBlock = %d, want %d", null, tc.wantNull)
			}
			if sent := (kvcore.BlockTable{{0, 3, kvcore.NullBlock}}); !reflect.DeepEqual(st.Requests[0].BlockTable, sent) {
				t.Fatalf("decoded table %v, want %v", st.Requests[0].BlockTable, sent)
			}
			if got := st.Requests[0].BlockTable.NormalizeNull(null); !reflect.DeepEqual(got, tc.table) {
				t.Fatalf("normalised %v, want %v", got, tc.table)
			}
			// Re-encoding keeps the declaration (0 is not dropped as empty).
			b, err := json.Marshal(st)
			if err != nil {
				t.Fatal(err)
			}
			var again contract.EngineStep
			if err := json.Unmarshal(b, &again); err != nil || !reflect.DeepEqual(again.NullBlockID, tc.want) {
				t.Fatalf("round trip %s: NullBlockID %v, %v", b, again.NullBlockID, err)
			}
		})
	}
}

// TestPDSourceNullBlockID decodes a prefill engine's declared null id in
// kv_transfer_params.
func TestPDSourceNullBlockID(t *testing.T) {
	var p contract.PDSource
	raw := `{"remote_engine_id":"prefill-0","remote_block_table":[[0,5]],"remote_tokens":32,"remote_null_block_id":0}`
	if err := json.Unmarshal([]byte(raw), &p); err != nil {
		t.Fatal(err)
	}
	if p.NullBlockID == nil || *p.NullBlockID != 0 {
		t.Fatalf("NullBlockID %v, want 0", p.NullBlockID)
	}
	if got := p.BlockTable.NormalizeNull(kvcore.EngineNullBlock(p.NullBlockID)); !reflect.DeepEqual(got, kvcore.BlockTable{{kvcore.NullBlock, 5}}) {
		t.Fatalf("normalised %v", got)
	}
	b, err := json.Marshal(contract.PDSource{EngineID: "p", BlockTable: kvcore.BlockTable{{1}}})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"remote_engine_id":"p","remote_block_table":[[1]],"remote_tokens":0}`; string(b) != want {
		t.Fatalf("a source without a declaration encodes %s, want %s", b, want)
	}
}

func TestDecodeEngineFeedback(t *testing.T) {
	one := `{"schema":"kvmesh.engine_feedback.v1","kind":"finished_sending","engine_id":"e","request_id":"r1"}`
	tests := []struct {
		name    string
		value   string
		want    []string // request ids
		wantErr bool
	}{
		{"a batch", `{"schema":"kvmesh.engine_feedback_batch.v1","engine_id":"e","feedback":[` + one + `,` +
			strings.Replace(one, "r1", "r2", 1) + `]}`, []string{"r1", "r2"}, false},
		{"a lone message (a scheduler before the batch)", one, []string{"r1"}, false},
		{"another schema", `{"schema":"kvmesh.transfer_result.v1"}`, nil, true},
		{"not JSON", `{`, nil, true},
		{"a batch of the wrong shape", `{"schema":"kvmesh.engine_feedback_batch.v1","feedback":{}}`, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fs, err := contract.DecodeEngineFeedback([]byte(tc.value))
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error %v", err, tc.wantErr)
			}
			var ids []string
			for _, f := range fs {
				ids = append(ids, f.RequestID)
			}
			if !slices.Equal(ids, tc.want) {
				t.Fatalf("messages %v, want %v", ids, tc.want)
			}
		})
	}
}
