package api

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
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

// compactModel is a one-group model at hash block size 16.
func compactModel() *kvcore.Model {
	return &kvcore.Model{Name: "m", HashBlockSize: 16, Groups: []kvcore.Group{
		{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 64}}}
}

// TestQueryCompactHashes: block_hashes_b64 is validated strictly, each
// failure naming its field, and a good one gives the hashes of the hex
// form.
func TestQueryCompactHashes(t *testing.T) {
	v := Validator{Model: compactModel()}
	// "qgG7As0D" is aa01 bb02 cd03: three 2-byte hashes.
	cases := []struct {
		name   string
		fields string
		field  string // "" when the request is valid
		detail string
	}{
		{"three 2-byte hashes", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"num_tokens":48`, "", ""},
		{"hashes past num_tokens unused", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"num_tokens":32`, "", ""},
		{"one 6-byte hash", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":6,"num_tokens":16`, "", ""},
		{"empty chain for a short prompt", `"block_hashes_b64":"","block_hash_bytes":32,"num_tokens":15`, "", ""},
		{"not base64", `"block_hashes_b64":"qgG7As0*","block_hash_bytes":2,"num_tokens":48`, "block_hashes_b64", "not padded standard base64"},
		{"url alphabet", `"block_hashes_b64":"qgG7As0_","block_hash_bytes":2,"num_tokens":48`, "block_hashes_b64", "not padded standard base64"},
		{"missing padding", `"block_hashes_b64":"qgG7As0","block_hash_bytes":1,"num_tokens":16`, "block_hashes_b64", "not padded standard base64"},
		{"non-canonical padding bits", `"block_hashes_b64":"qgG7As1=","block_hash_bytes":1,"num_tokens":16`, "block_hashes_b64", "not padded standard base64"},
		{"line break", `"block_hashes_b64":"qgG7\nAs0D","block_hash_bytes":2,"num_tokens":48`, "block_hashes_b64", "line breaks"},
		{"length not a multiple", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":4,"num_tokens":16`, "block_hashes_b64", "not a whole number of 4-byte hashes"},
		{"too few hashes", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"num_tokens":64`, "block_hashes_b64", "has 3 hashes"},
		{"no hash size", `"block_hashes_b64":"qgG7As0D","num_tokens":48`, "block_hash_bytes", "required"},
		{"hash size 0", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":0,"num_tokens":48`, "block_hash_bytes", "1 to 64"},
		{"hash size 65", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":65,"num_tokens":48`, "block_hash_bytes", "1 to 64"},
		{"hash size without compact hashes", `"block_hashes":["aa01"],"block_hash_bytes":2,"num_tokens":16`, "block_hash_bytes", "only applies"},
		{"with hex hashes", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"block_hashes":["aa01"],"num_tokens":16`, "block_hashes_b64", "not both"},
		{"with token ids", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"token_ids":[1,2]`, "block_hashes_b64", "not both"},
		{"no num_tokens", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2`, "num_tokens", "required with block_hashes_b64"},
		{"negative num_tokens", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"num_tokens":-1`, "num_tokens", "negative"},
		{"with extra", `"block_hashes_b64":"qgG7As0D","block_hash_bytes":2,"num_tokens":48,"extra":"salt"`, "extra", "only applies to token_ids"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var req Request
			if err := json.Unmarshal([]byte(`{"engine_id":"e","request_id":"r","model":"m",`+tc.fields+`}`), &req); err != nil {
				t.Fatal(err)
			}
			_, err := v.Query(&req)
			var fe *FieldError
			switch {
			case tc.field == "" && err != nil:
				t.Fatalf("valid request refused: %v", err)
			case tc.field == "":
				return
			case !errors.As(err, &fe):
				t.Fatalf("error %v, want a *FieldError on %s", err, tc.field)
			case fe.Field != tc.field || !strings.Contains(fe.Detail, tc.detail):
				t.Fatalf("error on %q: %q; want %q saying %q", fe.Field, fe.Detail, tc.field, tc.detail)
			}
		})
	}
}

// TestQueryHashFormsAgree: the hex and base64 forms of one chain give the
// same query, and a hex chain of mixed case decodes as the lower-case one.
func TestQueryHashFormsAgree(t *testing.T) {
	v := Validator{Model: compactModel()}
	cases := []struct {
		name      string
		hex, b64  string
		size, num int
	}{
		{"2-byte hashes", `["aa01","bb02","cd03"]`, "qgG7As0D", 2, 48},
		{"upper-case hex", `["AA01","bB02","Cd03"]`, "qgG7As0D", 2, 40},
		{"32-byte hashes", `["` + strings.Repeat("00ff", 16) + `","` + strings.Repeat("a5", 32) + `"]`,
			base64.StdEncoding.EncodeToString(append(bytes.Repeat([]byte{0, 0xff}, 16), bytes.Repeat([]byte{0xa5}, 32)...)), 32, 32},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			query := func(fields string) *connector.Query {
				var req Request
				if err := json.Unmarshal([]byte(`{"engine_id":"e","request_id":"r","model":"m",`+fields+`}`), &req); err != nil {
					t.Fatal(err)
				}
				q, err := v.Query(&req)
				if err != nil {
					t.Fatal(err)
				}
				return q
			}
			byHex := query(fmt.Sprintf(`"block_hashes":%s,"num_tokens":%d`, tc.hex, tc.num))
			byB64 := query(fmt.Sprintf(`"block_hashes_b64":%q,"block_hash_bytes":%d,"num_tokens":%d`, tc.b64, tc.size, tc.num))
			if !reflect.DeepEqual(byHex, byB64) {
				t.Fatalf("hex query %+v, base64 query %+v", byHex, byB64)
			}
			if len(byHex.Hashes) != tc.num/16 {
				t.Fatalf("%d hashes, want %d", len(byHex.Hashes), tc.num/16)
			}
		})
	}
}

// TestDecodeHashesNamesTheFirstBadHash: the hex form's errors name the
// first bad hash and say why.
func TestDecodeHashesNamesTheFirstBadHash(t *testing.T) {
	cases := []struct {
		name   string
		hexes  []string
		field  string
		detail string
	}{
		{"not hex", []string{"aa01", "zz02"}, "block_hashes[1]", "not hex"},
		{"odd length first", []string{"aa0", "bb02"}, "block_hashes[0]", "not hex"},
		{"odd length later", []string{"aa01", "bb0"}, "block_hashes[1]", "not hex"},
		{"empty", []string{"", "bb02"}, "block_hashes[0]", "empty"},
		{"too long", []string{strings.Repeat("ab", 65)}, "block_hashes[0]", "at most 64"},
		{"two lengths", []string{"aa01", "bb02", "cc0304"}, "block_hashes[2]", "one length"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeHashes(tc.hexes)
			if err == nil || err.Field != tc.field || !strings.Contains(err.Detail, tc.detail) {
				t.Fatalf("error %v, want %s saying %q", err, tc.field, tc.detail)
			}
		})
	}
	got, err := decodeHashes([]string{"00ff", "A5b6"})
	if err != nil || !reflect.DeepEqual(got, []kvcore.BlockHash{{0, 0xff}, {0xa5, 0xb6}}) {
		t.Fatalf("decodeHashes = %x, %v", got, err)
	}
}

// TestIsBinary: only the binary lookup media type, in any case and with
// parameters, selects the binary body.
func TestIsBinary(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/vnd.kvmesh.lookup":             true,
		"Application/VND.kvmesh.Lookup; version=1":  true,
		"application/vnd.kvmesh.lookupx":            false,
		"application/vnd.kvmesh.lookup+json":        false,
		"application/json":                          false,
		"":                                          false,
		"application/vnd.kvmesh.lookup; broken=\"x": false,
	} {
		if got := isBinary(ct); got != want {
			t.Errorf("isBinary(%q) = %v, want %v", ct, got, want)
		}
	}
}
