package app_test

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestHashFormsGiveOneDecision: a request sent as token ids, as the hex
// hash chain, as the compact block_hashes_b64 chain and as a binary body
// (application/vnd.kvmesh.lookup) gets the same
// decision (up to its id and request id) from a two-group service whose
// store holds part of the prompt, for a hit, a hit cut by the full-hit
// rule and a miss; the compact form also takes an engine's own 8-byte
// hashes.
func TestHashFormsGiveOneDecision(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specFullMamba)})
	toks := tokens(96, 301)
	hashes := kvcore.HashChain(toks, 16, nil)
	// Full attention holds blocks 0–3, Mamba block 1 and 3: the hit is 64.
	seed.put(t, groupKeys(s.keys(), 0, hashes, 0, 1, 2, 3)...)
	seed.put(t, groupKeys(s.keys(), 1, hashes, 1, 3)...)
	own := make([]kvcore.BlockHash, 6)
	for i := range own {
		own[i] = kvcore.BlockHash{byte(i), 1, 2, 3, 4, 5, 6, 7}
	}
	seed.put(t, groupKeys(s.keys(), 0, own, 0, 1)...)
	seed.put(t, groupKeys(s.keys(), 1, own, 1)...)
	cases := []struct {
		name     string
		toks     []uint32 // nil: an engine's own chain
		hashes   []kvcore.BlockHash
		computed int
		want     int
	}{
		{"hit", toks, hashes, 0, 64},
		{"hit less computed", toks, hashes, 16, 64},
		{"full hit rule", toks[:64], hashes[:4], 0, 32},
		{"miss", tokens(48, 302), kvcore.HashChain(tokens(48, 302), 16, nil), 0, 0},
		{"engine's own 8-byte hashes", nil, own, 0, 32},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := 16 * len(tc.hashes)
			forms := map[string]map[string]any{
				"block_hashes":     {"block_hashes": hexes(tc.hashes), "num_tokens": n},
				"block_hashes_b64": {"block_hashes_b64": compact(tc.hashes), "block_hash_bytes": len(tc.hashes[0]), "num_tokens": n},
			}
			if tc.toks != nil {
				forms["token_ids"] = map[string]any{"token_ids": tc.toks}
			}
			forms["binary"] = map[string]any{"block_hash_bytes": len(tc.hashes[0]), "num_tokens": n}
			var first *contract.LookupDecision
			for name, fields := range forms {
				fields["engine_id"], fields["request_id"], fields["model"] = "engine-0", "forms-"+name, "test-model"
				fields["num_computed_tokens"] = tc.computed
				var d contract.LookupDecision
				if name == "binary" {
					d = decodeDecision(t, s.post(t, binaryBody(t, fields, tc.hashes), binaryType))
				} else {
					d = s.lookup(t, fields)
				}
				if d.ExternalTokens != max(0, tc.want-tc.computed) {
					t.Errorf("%s: external tokens %d, want %d", name, d.ExternalTokens, max(0, tc.want-tc.computed))
				}
				d.DecisionID, d.RequestID = "", ""
				if first == nil {
					first = &d
				} else if asJSON(d) != asJSON(*first) {
					t.Errorf("%s: decision %s, another form %s", name, asJSON(d), asJSON(*first))
				}
			}
		})
	}
}

// compact is the block_hashes_b64 form of a hash chain.
func compact(hs []kvcore.BlockHash) string {
	var raw []byte
	for _, h := range hs {
		raw = append(raw, h...)
	}
	return base64.StdEncoding.EncodeToString(raw)
}

// binaryType is the header of a binary lookup body.
var binaryType = map[string]string{"Content-Type": "application/vnd.kvmesh.lookup"}

// binaryBody is a binary lookup body: head on one line, '\n', the raw
// hashes concatenated.
func binaryBody(t *testing.T, head map[string]any, hs []kvcore.BlockHash) string {
	t.Helper()
	b, err := json.Marshal(head)
	if err != nil {
		t.Fatal(err)
	}
	b = append(b, '\n')
	for _, h := range hs {
		b = append(b, h...)
	}
	return string(b)
}

// TestBinaryBodyRefusals: a binary body is refused with a problem naming
// what is wrong in it, and the store is not asked.
func TestBinaryBodyRefusals(t *testing.T) {
	env := servicetest.NewEnv(t)
	s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_MAX_BODY_BYTES": "4096"})
	head := func(edit func(map[string]any)) map[string]any {
		m := map[string]any{"engine_id": "e", "request_id": "r", "model": "test-model", "block_hash_bytes": 2, "num_tokens": 48}
		edit(m)
		return m
	}
	three := []kvcore.BlockHash{{0xaa, 1}, {0xbb, 2}, {0xcc, 3}}
	keep := func(map[string]any) {}
	cases := []struct {
		name   string
		body   string
		status int
		field  string
		detail string
	}{
		{"no head line", `{"engine_id":"e"}`, 400, "", "no '\\n' found"},
		{"head not JSON", "{\"engine_id\":\n\xaa\x01", 400, "", "malformed JSON"},
		{"unknown head field", binaryBody(t, head(func(m map[string]any) { m["colour"] = 1 }), three), 400, "colour", "unknown field"},
		{"hashes of the wrong length", binaryBody(t, head(keep), three)[:len(binaryBody(t, head(keep), three))-1], 400, "(binary hashes)", "not a whole number of 2-byte hashes"},
		{"too few hashes", binaryBody(t, head(keep), three[:2]), 400, "(binary hashes)", "at least 3"},
		{"no hash size", binaryBody(t, head(func(m map[string]any) { delete(m, "block_hash_bytes") }), three), 400, "block_hash_bytes", "required with (binary hashes)"},
		{"no num_tokens", binaryBody(t, head(func(m map[string]any) { delete(m, "num_tokens") }), three), 400, "num_tokens", "required"},
		{"a chain in the head too", binaryBody(t, head(func(m map[string]any) { m["block_hashes"] = []string{"aa01"} }), three), 400, "block_hashes", "after the head"},
		{"over the body limit", binaryBody(t, head(keep), make([]kvcore.BlockHash, 3000)) + strings.Repeat("x", 4096), 413, "", "exceeds 4096 bytes"},
	}
	calls := s.metric(t, existsCalls)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := s.post(t, tc.body, binaryType).problem(t, tc.status)
			if field, _ := p.Extras["field"].(string); field != tc.field {
				t.Errorf("problem field %q, want %q (detail %q)", field, tc.field, p.Detail)
			}
			if !strings.Contains(p.Detail, tc.detail) {
				t.Errorf("problem detail %q should say %q", p.Detail, tc.detail)
			}
		})
	}
	if got := s.metric(t, existsCalls); got != calls {
		t.Errorf("bad binary bodies made %v existence calls, want none", got-calls)
	}
	if res := s.post(t, binaryBody(t, head(keep), three), binaryType); res.status != http.StatusOK {
		t.Fatalf("a good binary body: %d %s", res.status, res.body)
	}
}
