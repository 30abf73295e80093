package app_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
)

// TestBadInput drives each kind of bad request at a running service: each
// gets the right 4xx and a problem body naming the offending field, and
// none touches the store.
func TestBadInput(t *testing.T) {
	env := servicetest.NewEnv(t)
	s := startLookup(t, env, map[string]string{
		"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_CONNECTORS": "pd,store",
		"KVMESH_LOOKUP_MAX_BODY_BYTES": "65536",
	})
	// 48 tokens need 3 hashes at hash block 16.
	good := func(edit func(m map[string]any)) string {
		m := map[string]any{
			"engine_id": "e", "request_id": "r", "model": "test-model",
			"block_hashes": []string{"aa01", "bb02", "cc03"}, "num_tokens": 48,
		}
		edit(m)
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	// b64 swaps the hex hashes for compact ones of size bytes each (0:
	// block_hash_bytes left out).
	b64 := func(hashes string, size int) func(map[string]any) {
		return func(m map[string]any) {
			delete(m, "block_hashes")
			m["block_hashes_b64"] = hashes
			if size != 0 {
				m["block_hash_bytes"] = size
			}
		}
	}
	pd := func(p map[string]any) func(map[string]any) {
		return func(m map[string]any) { m["kv_transfer_params"] = p }
	}
	cases := []struct {
		name        string
		body        string
		contentType string
		status      int
		field       string // "" when the problem cannot name one
		detail      string
	}{
		{"malformed JSON", `{"engine_id": "e",`, "", 400, "", "malformed JSON"},
		{"not an object", `[1,2,3]`, "", 400, "", "JSON object"},
		{"unknown field", good(func(m map[string]any) { m["colour"] = "red" }), "", 400, "colour", "unknown field"},
		{"unknown field in kv_transfer_params", good(pd(map[string]any{"remote_engine_id": "p", "remote_block_table": [][]int{{1}}, "do_remote_prefill": true})), "", 400, "do_remote_prefill", "unknown field"},
		{"wrong type", good(func(m map[string]any) { m["num_tokens"] = "48" }), "", 400, "num_tokens", "integer"},
		{"negative token id", good(func(m map[string]any) { delete(m, "block_hashes"); m["token_ids"] = []int{1, -2} }), "", 400, "token_ids", "integer"},
		{"missing engine_id", good(func(m map[string]any) { delete(m, "engine_id") }), "", 400, "engine_id", "required"},
		{"overlong request_id", good(func(m map[string]any) { m["request_id"] = strings.Repeat("r", 257) }), "", 400, "request_id", "at most 256"},
		{"unknown model", good(func(m map[string]any) { m["model"] = "llama-9000" }), "", 400, "model", "not served here"},
		{"both token_ids and block_hashes", good(func(m map[string]any) { m["token_ids"] = []int{1, 2} }), "", 400, "token_ids", "not both"},
		{"neither token_ids nor block_hashes", good(func(m map[string]any) { delete(m, "block_hashes") }), "", 400, "token_ids", "required"},
		{"num_tokens disagrees with token_ids", good(func(m map[string]any) { delete(m, "block_hashes"); m["token_ids"] = []int{1, 2}; m["num_tokens"] = 3 }), "", 400, "num_tokens", "holds 2 tokens"},
		{"block_hashes without num_tokens", good(func(m map[string]any) { delete(m, "num_tokens") }), "", 400, "num_tokens", "required"},
		{"negative num_tokens", good(func(m map[string]any) { m["num_tokens"] = -1 }), "", 400, "num_tokens", "negative"},
		{"negative num_computed_tokens", good(func(m map[string]any) { m["num_computed_tokens"] = -16 }), "", 400, "num_computed_tokens", "negative"},
		{"num_computed_tokens beyond num_tokens", good(func(m map[string]any) { m["num_computed_tokens"] = 64 }), "", 400, "num_computed_tokens", "more than"},
		{"too few block_hashes", good(func(m map[string]any) { m["num_tokens"] = 64 }), "", 400, "block_hashes", "at least 4"},
		{"non-hex block hash", good(func(m map[string]any) { m["block_hashes"] = []string{"aa01", "zz02", "cc03"} }), "", 400, "block_hashes[1]", "not hex"},
		{"odd-length block hash", good(func(m map[string]any) { m["block_hashes"] = []string{"aa0", "bb02", "cc03"} }), "", 400, "block_hashes[0]", "not hex"},
		{"empty block hash", good(func(m map[string]any) { m["block_hashes"] = []string{"", "bb02", "cc03"} }), "", 400, "block_hashes[0]", "empty"},
		{"block hashes of two lengths", good(func(m map[string]any) { m["block_hashes"] = []string{"aa01", "bb02", "cc0304"} }), "", 400, "block_hashes[2]", "one length"},
		{"oversized block hash", good(func(m map[string]any) { m["block_hashes"] = []string{strings.Repeat("ab", 65), "bb02", "cc03"} }), "", 400, "block_hashes[0]", "at most 64"},
		{"extra with block_hashes", good(func(m map[string]any) { m["extra"] = "salt" }), "", 400, "extra", "token_ids"},
		{"compact hashes not base64", good(b64("qgG7As*D", 2)), "", 400, "block_hashes_b64", "not padded standard base64"},
		{"compact hashes of the wrong length", good(b64("qgG7AswD", 4)), "", 400, "block_hashes_b64", "not a whole number"},
		{"too few compact hashes", good(b64("qgG7Ag==", 2)), "", 400, "block_hashes_b64", "at least 3"},
		{"compact hashes with a line break", good(b64("qgG7\nAswD", 2)), "", 400, "block_hashes_b64", "line breaks"},
		{"compact hashes without their size", good(b64("qgG7AswD", 0)), "", 400, "block_hash_bytes", "required"},
		{"compact hash size over 64", good(b64("qgG7AswD", 65)), "", 400, "block_hash_bytes", "1 to 64"},
		{"both hash forms", good(func(m map[string]any) { m["block_hashes_b64"], m["block_hash_bytes"] = "qgG7AswD", 2 }), "", 400, "block_hashes_b64", "not both"},
		{"hash size without compact hashes", good(func(m map[string]any) { m["block_hash_bytes"] = 2 }), "", 400, "block_hash_bytes", "only applies"},
		{"pd source without engine", good(pd(map[string]any{"remote_block_table": [][]int{{1}}, "remote_tokens": 16})), "", 400, "kv_transfer_params.remote_engine_id", "required"},
		{"pd source with negative tokens", good(pd(map[string]any{"remote_engine_id": "p", "remote_block_table": [][]int{{1}}, "remote_tokens": -1})), "", 400, "kv_transfer_params.remote_tokens", "negative"},
		{"pd table of the wrong group count", good(pd(map[string]any{"remote_engine_id": "p", "remote_block_table": [][]int{{1}, {2}}, "remote_tokens": 16})), "", 400, "kv_transfer_params.remote_block_table", "2 groups"},
		{"pd table with a bad block id", good(pd(map[string]any{"remote_engine_id": "p", "remote_block_table": [][]int{{1, -7}}, "remote_tokens": 16})), "", 400, "kv_transfer_params.remote_block_table[0][1]", "-7"},
		{"pd source with a negative null block id", good(pd(map[string]any{"remote_engine_id": "p", "remote_block_table": [][]int{{1}}, "remote_tokens": 16, "remote_null_block_id": -1})), "", 400, "kv_transfer_params.remote_null_block_id", "negative"},
		{"oversized body", good(func(m map[string]any) { delete(m, "block_hashes"); m["token_ids"] = make([]int, 40000) }), "", 413, "", "exceeds 65536 bytes"},
		{"not JSON", good(func(map[string]any) {}), "text/plain", 415, "", "text/plain"},
	}
	calls := s.metric(t, existsCalls)
	invalid := s.metric(t, `kvmesh_lookup_requests_total{result="invalid"}`)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			hdr := map[string]string{}
			if tc.contentType != "" {
				hdr["Content-Type"] = tc.contentType
			}
			p := s.post(t, tc.body, hdr).problem(t, tc.status)
			if field, _ := p.Extras["field"].(string); field != tc.field {
				t.Errorf("problem field %q, want %q (detail %q)", field, tc.field, p.Detail)
			}
			if !strings.Contains(p.Detail, tc.detail) || (tc.field != "" && !strings.Contains(p.Detail, tc.field)) {
				t.Errorf("problem detail %q should name %q and say %q", p.Detail, tc.field, tc.detail)
			}
		})
	}
	if got := s.metric(t, existsCalls); got != calls {
		t.Errorf("bad requests made %v existence calls, want none", got-calls)
	}
	if got := s.metric(t, `kvmesh_lookup_requests_total{result="invalid"}`) - invalid; got != float64(len(cases)) {
		t.Errorf("kvmesh_lookup_requests_total{result=\"invalid\"} rose by %v, want %d", got, len(cases))
	}
	// The same service still answers a good request.
	good200 := s.post(t, good(func(map[string]any) {}), nil)
	if good200.status != http.StatusOK {
		t.Fatalf("valid request after the bad ones: %d %s", good200.status, good200.body)
	}
}
