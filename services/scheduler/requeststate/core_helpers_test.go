package requeststate

import (
	"encoding/json"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Test helpers shared with pkg/kvcore's tests (copied with the tracker
// tests that use them).

// checkVerdicts asserts the shape of ValidateSave's answer: one verdict per
// model group in order, then one per out-of-range or duplicate entry.
func checkVerdicts(t *testing.T, m *kvcore.Model, task *kvcore.SaveTask, vs []kvcore.GroupVerdict) {
	t.Helper()
	var extra []kvcore.GroupVerdict
	seen := map[int]bool{}
	for _, e := range task.Groups {
		switch {
		case e.Group < 0 || e.Group >= len(m.Groups):
			extra = append(extra, kvcore.GroupVerdict{Group: e.Group, Reason: kvcore.ReasonGroupOutOfRange})
		case seen[e.Group]:
			extra = append(extra, kvcore.GroupVerdict{Group: e.Group, Reason: kvcore.ReasonGroupDuplicate})
		}
		seen[e.Group] = true
	}
	if len(vs) != len(m.Groups)+len(extra) {
		t.Fatalf("%d verdicts for %d groups and %d extra entries: %+v", len(vs), len(m.Groups), len(extra), vs)
	}
	for g := range m.Groups {
		if vs[g].Group != g {
			t.Fatalf("verdict %d names group %d", g, vs[g].Group)
		}
		if !vs[g].OK() && vs[g].Detail == "" {
			t.Fatalf("group %d: %s without detail", g, vs[g].Reason)
		}
	}
	for i, e := range extra {
		if v := vs[len(m.Groups)+i]; v.Group != e.Group || v.Reason != e.Reason {
			t.Fatalf("extra verdict %d = %+v, want %+v", i, v, e)
		}
	}
}

// decodeTable decodes a JSON block table.
func decodeTable(t *testing.T, s string) kvcore.BlockTable {
	t.Helper()
	var tb kvcore.BlockTable
	if err := json.Unmarshal([]byte(s), &tb); err != nil {
		t.Fatalf("decode %s: %v", s, err)
	}
	return tb
}

// fuzzPresets loads every shipped preset, in PresetNames order.
func fuzzPresets(t testing.TB) []*kvcore.Model {
	t.Helper()
	var out []*kvcore.Model
	for _, name := range kvcore.PresetNames() {
		m, err := kvcore.Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

func grpFull(bs int) kvcore.Group { return kvcore.Group{Kind: kvcore.KindFullAttention, BlockSize: bs} }

func grpMLA(bs int) kvcore.Group { return kvcore.Group{Kind: kvcore.KindMLA, BlockSize: bs} }

func grpMamba(bs int) kvcore.Group { return kvcore.Group{Kind: kvcore.KindMamba, BlockSize: bs} }

func grpSWA(bs, window int) kvcore.Group {
	return kvcore.Group{Kind: kvcore.KindSlidingWindow, BlockSize: bs, Window: window}
}

func hexes(hashes []kvcore.BlockHash) []string {
	out := make([]string, len(hashes))
	for i, h := range hashes {
		out[i] = h.Hex()
	}
	return out
}

// lookupModel is a valid test model named "test-model" with the given hash
// block size and groups (bytes_per_block filled in).
func lookupModel(hashBS int, groups ...kvcore.Group) *kvcore.Model {
	m := &kvcore.Model{Name: "test-model", HashBlockSize: hashBS}
	for _, g := range groups {
		if g.BytesPerBlock == 0 {
			g.BytesPerBlock = 1024
		}
		m.Groups = append(m.Groups, g)
	}
	return m
}

// nullOf is a declared null block id.
func nullOf(v int64) *int64 { return &v }

// partialModel is the MLA + linear-attention shape with partial hash hits:
// MLA 64 and Mamba 64 (align mode), hash block 16, so a Mamba block is 4
// hash blocks (coordinator.py partial_hash_hits_enabled).
func partialModel() *kvcore.Model { return lookupModel(16, grpMLA(64), grpMamba(64)) }

// promptHashes is the hash chain of n tokens at m's hash block size.
func promptHashes(m *kvcore.Model, n int, seed uint32) []kvcore.BlockHash {
	return kvcore.HashChain(promptTokens(n, seed), m.HashBlockSize, nil)
}

// seqTokens is n token ids 1, 2, …, n.
func seqTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i + 1)
	}
	return out
}

// promptTokens returns n deterministic token ids, different per seed.
func promptTokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	x := seed*2654435761 + 1
	for i := range out {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		out[i] = x % 150000
	}
	return out
}
