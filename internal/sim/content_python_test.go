package sim

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
)

// The Python twin of the block content (connectors/vllm/kvmesh_vllm/
// content.py) must agree with BlockContent and Model.StoreRank: these
// tests run its interop script (connectors/vllm/tests/interop/
// content_interop.py) with Debian's Python. They skip when that Python
// cannot import numpy, and fail instead with KVMESH_REQUIRE_PYTHON=1.

// runContentPython runs the content interop script on req and decodes its
// answer into out (testenv.RunInterop: skipped, or failed under
// KVMESH_REQUIRE_PYTHON=1, without numpy).
func runContentPython(t *testing.T, req, out any) {
	t.Helper()
	testenv.RunInterop(t, "content_interop.py", req, out)
}

// pythonModels are the presets and a few parallel layouts whose store
// ranks differ: GQA sharing, MLA, DCP, PCP and PP.
func pythonModels(t *testing.T) map[string]*kvcore.Model {
	t.Helper()
	out := map[string]*kvcore.Model{}
	for _, name := range kvcore.PresetNames() {
		out[name] = preset(t, name)
	}
	for name, spec := range map[string]string{
		"gqa-tp8-kv2": `
name: gqa
hash_block_size: 16
kv_heads: 2
parallel: {tp: 8, pp: 2}
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 4096}
  - {kind: mla, block_size: 16, bytes_per_block: 1000}
  - {kind: mamba, block_size: 16, bytes_per_block: 333}
`,
		"dcp": `
name: dcp
hash_block_size: 16
kv_heads: 1
parallel: {tp: 4, dcp: 2}
groups:
  - {kind: mla, cache_block_size: 16, bytes_per_block: 777}
`,
		"pcp": `
name: pcp
hash_block_size: 16
parallel: {tp: 2, pcp: 2, pp: 3}
groups:
  - {kind: full_attention, cache_block_size: 16, bytes_per_block: 100}
`,
		"kv-heads-over-tp": `
name: many-heads
hash_block_size: 16
kv_heads: 16
parallel: {tp: 4}
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 64}
  - {kind: sliding_window, block_size: 16, window: 64, bytes_per_block: 64}
`,
	} {
		m, err := kvcore.ParseModel([]byte(spec))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = m
	}
	return out
}

// TestPythonBlockContent: Python's block_content (and fill_regions over
// odd region cuts) gives exactly BlockContent's bytes for every preset and
// more, over groups, store ranks and hashes of several lengths.
func TestPythonBlockContent(t *testing.T) {
	type query struct {
		Fingerprint string      `json:"fingerprint"`
		Group       int         `json:"group"`
		Rank        kvcore.Rank `json:"rank"`
		Hash        string      `json:"hash"`
		NBytes      int64       `json:"nbytes"`
		Regions     []int64     `json:"regions"`
	}
	hashes := []kvcore.BlockHash{
		kvcore.HashTokens(nil, []uint32{1, 2, 3}, nil),
		{0x00},
		{0xde, 0xad, 0xbe, 0xef, 0x01},
		bytes.Repeat([]byte{0xa5}, 127),
	}
	var queries []query
	var want []string
	for name, m := range pythonModels(t) {
		c := newContents(m)
		for g, grp := range m.Groups {
			nss := m.Namespaces(g)
			for i, h := range hashes {
				sr := nss[(i+g)%len(nss)]
				data := c.nsBlock(g, sr, h)
				if r := m.WorkerRanks()[i%m.WorldSize()]; m.StoreRank(g, r) == sr && !bytes.Equal(data, BlockContent(m, g, r, h)) {
					t.Fatalf("%s: nsBlock differs from BlockContent", name)
				}
				sum := sha256.Sum256(data)
				queries = append(queries, query{Fingerprint: c.fp, Group: g, Rank: sr, Hash: h.Hex(), NBytes: grp.BytesPerBlock})
				want = append(want, hex.EncodeToString(sum[:]))
				// The same block cut into regions that split words.
				n := grp.BytesPerBlock
				cuts := []int64{min(3, n), min(13, n-min(3, n))}
				cuts = append(cuts, n-cuts[0]-cuts[1])
				dst := kvmem.Split(make([]byte, n), cuts)
				c.nsFill(dst, g, sr, h)
				sum = sha256.Sum256(bytes.Join(dst, nil))
				queries = append(queries, query{Fingerprint: c.fp, Group: g, Rank: sr, Hash: h.Hex(), NBytes: n, Regions: cuts})
				want = append(want, hex.EncodeToString(sum[:]))
			}
		}
	}
	// A size that is no whole number of words, and an empty block.
	m := preset(t, "dense")
	c := newContents(m)
	for _, n := range []int64{0, 1, 7, 9, 33, 4097} {
		s := c.stream(0, kvcore.Rank{}, hashes[0])
		out := make([]byte, n)
		s.fill(out)
		sum := sha256.Sum256(out)
		queries = append(queries, query{Fingerprint: c.fp, Hash: hashes[0].Hex(), NBytes: n})
		want = append(want, hex.EncodeToString(sum[:]))
	}
	var ans struct {
		Blocks []string `json:"blocks"`
	}
	runContentPython(t, map[string]any{"blocks": queries, "ranks": []any{}}, &ans)
	if len(ans.Blocks) != len(queries) {
		t.Fatalf("%d answers for %d blocks", len(ans.Blocks), len(queries))
	}
	for i, q := range queries {
		if ans.Blocks[i] != want[i] {
			t.Errorf("block %+v: python's content differs from go's", q)
		}
	}
}

// TestPythonStoreRank: Python's store_rank and worker_ranks, given the
// model spec as JSON (as `kvmesh model --json` prints its "model"), are
// Model.StoreRank and Model.WorkerRanks for every group and worker rank.
func TestPythonStoreRank(t *testing.T) {
	type query struct {
		Model      json.RawMessage `json:"model"`
		Group      int             `json:"group"`
		WorkerRank kvcore.Rank     `json:"worker_rank"`
	}
	models := pythonModels(t)
	if _, ok := models["hybrid-mla-linear-tp8"]; !ok {
		t.Fatal("no hybrid-mla-linear-tp8 preset")
	}
	var queries []query
	var want []kvcore.Rank
	var specs []json.RawMessage
	var wantWorkers [][]kvcore.Rank
	for _, m := range models {
		spec, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		specs = append(specs, spec)
		wantWorkers = append(wantWorkers, m.WorkerRanks())
		for g := range m.Groups {
			for _, r := range m.WorkerRanks() {
				queries = append(queries, query{Model: spec, Group: g, WorkerRank: r})
				want = append(want, m.StoreRank(g, r))
			}
		}
	}
	var ans struct {
		StoreRanks  []kvcore.Rank   `json:"store_ranks"`
		WorkerRanks [][]kvcore.Rank `json:"worker_ranks"`
	}
	runContentPython(t, map[string]any{"blocks": []any{}, "ranks": queries, "models": specs}, &ans)
	if len(ans.StoreRanks) != len(queries) || len(ans.WorkerRanks) != len(specs) {
		t.Fatalf("%d store ranks for %d queries, %d worker rank lists for %d models", len(ans.StoreRanks), len(queries), len(ans.WorkerRanks), len(specs))
	}
	shared := 0
	for i, q := range queries {
		if ans.StoreRanks[i] != want[i] {
			t.Errorf("model %s group %d rank %v: python store rank %v, go %v", q.Model, q.Group, q.WorkerRank, ans.StoreRanks[i], want[i])
		}
		if want[i] != q.WorkerRank {
			shared++
		}
	}
	if shared == 0 {
		t.Fatal("no query has a store rank other than its worker rank: the test checks nothing")
	}
	for i := range specs {
		if len(ans.WorkerRanks[i]) != len(wantWorkers[i]) {
			t.Errorf("model %s: python worker ranks %v, go %v", specs[i], ans.WorkerRanks[i], wantWorkers[i])
			continue
		}
		for j := range wantWorkers[i] {
			if ans.WorkerRanks[i][j] != wantWorkers[i][j] {
				t.Errorf("model %s: python worker ranks %v, go %v", specs[i], ans.WorkerRanks[i], wantWorkers[i])
				break
			}
		}
	}
}
