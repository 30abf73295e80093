package api

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestQueryNormalisesTheRemoteNullBlock: the prefill engine's declared null
// block id (kv_transfer_params.remote_null_block_id; vLLM's is 0) becomes
// null in the remote table once, at validation, and the declaration is
// dropped, so the decision and the load task only carry JSON null. Without
// a declaration block 0 is a real block.
func TestQueryNormalisesTheRemoteNullBlock(t *testing.T) {
	v := Validator{Model: &kvcore.Model{Name: "m", HashBlockSize: 16, Groups: []kvcore.Group{
		{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 64}, {Kind: kvcore.KindMamba, BlockSize: 16, BytesPerBlock: 64}}}}
	cases := []struct {
		name   string
		params string
		want   kvcore.BlockTable
	}{
		{"null id 0", `,"remote_null_block_id":0`, kvcore.BlockTable{{kvcore.NullBlock, 4, 5}, {kvcore.NullBlock, kvcore.NullBlock, 6}}},
		{"no declaration", ``, kvcore.BlockTable{{0, 4, 5}, {0, kvcore.NullBlock, 6}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			raw := `{"engine_id":"decode-0","request_id":"r","model":"m","token_ids":[1,2,3,4],
				"kv_transfer_params":{"remote_engine_id":"prefill-0","remote_tokens":48,"remote_block_table":[[0,4,5],[0,null,6]]` + tc.params + `}}`
			var req Request
			if err := json.Unmarshal([]byte(raw), &req); err != nil {
				t.Fatal(err)
			}
			q, err := v.Query(&req)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(q.Transfer.BlockTable, tc.want) || q.Transfer.NullBlockID != nil {
				t.Fatalf("transfer table %v (null id %v), want %v with no declaration", q.Transfer.BlockTable, q.Transfer.NullBlockID, tc.want)
			}
			if want := (kvcore.BlockTable{{0, 4, 5}, {0, kvcore.NullBlock, 6}}); !reflect.DeepEqual(req.KVTransferParams.BlockTable, want) {
				t.Fatalf("the request's own table changed: %v", req.KVTransferParams.BlockTable)
			}
		})
	}
}
