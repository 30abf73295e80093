package sim

import (
	"bytes"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func preset(t *testing.T, name string) *kvcore.Model {
	t.Helper()
	m, err := kvcore.Preset(name)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestBlockContent(t *testing.T) {
	m := preset(t, "hybrid-mla-linear")
	h1 := kvcore.HashTokens(nil, []uint32{1, 2, 3}, nil)
	h2 := kvcore.HashTokens(nil, []uint32{1, 2, 4}, nil)
	a := BlockContent(m, 0, kvcore.Rank{}, h1)
	if int64(len(a)) != m.Groups[0].BytesPerBlock {
		t.Fatalf("%d bytes, want bytes_per_block %d", len(a), m.Groups[0].BytesPerBlock)
	}
	if !bytes.Equal(a, BlockContent(m, 0, kvcore.Rank{}, h1)) {
		t.Fatal("the same block has two contents")
	}
	if bytes.Equal(a, BlockContent(m, 0, kvcore.Rank{}, h2)) {
		t.Fatal("two hashes share contents")
	}
	if g1 := BlockContent(m, 1, kvcore.Rank{}, h1); bytes.Equal(a, g1[:len(a)]) {
		t.Fatal("two groups share contents")
	}
	c := newContents(m)
	if !c.matches(a, 0, kvcore.Rank{}, h1) || c.matches(a, 0, kvcore.Rank{}, h2) || c.matches(a[1:], 0, kvcore.Rank{}, h1) {
		t.Fatal("matches does not tell right from wrong bytes")
	}
	flipped := slices.Clone(a)
	flipped[len(flipped)/2] ^= 1
	if c.matches(flipped, 0, kvcore.Rank{}, h1) {
		t.Fatal("one flipped bit matched")
	}
}

// TestBlockContentRanks: MLA blocks are stored once for every TP rank, so
// their contents cannot depend on the TP rank; full-attention blocks do.
func TestBlockContentRanks(t *testing.T) {
	m := &kvcore.Model{Name: "tp2", HashBlockSize: 16, Parallel: kvcore.Parallel{TP: 2}, Groups: []kvcore.Group{
		{Kind: kvcore.KindMLA, BlockSize: 16, BytesPerBlock: 64},
		{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 64},
	}}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	h := kvcore.HashTokens(nil, []uint32{9}, nil)
	r0, r1 := kvcore.Rank{TP: 0}, kvcore.Rank{TP: 1}
	if !bytes.Equal(BlockContent(m, 0, r0, h), BlockContent(m, 0, r1, h)) {
		t.Fatal("MLA contents differ between TP ranks")
	}
	if bytes.Equal(BlockContent(m, 1, r0, h), BlockContent(m, 1, r1, h)) {
		t.Fatal("full-attention contents are the same on two TP ranks")
	}
}

// TestContentStreamPieces: the stream is the same however it is cut into
// fills (a block's regions need not be whole words), and its first word
// is SplitMix64's for the key, so another implementation can check itself
// against it.
func TestContentStreamPieces(t *testing.T) {
	whole := make([]byte, 1000)
	s := contentStream{key: 42}
	s.fill(whole)
	for _, cuts := range [][]int{{1}, {3, 5, 7}, {8, 16, 17}, {999}, {0, 0, 13}} {
		got := make([]byte, 0, len(whole))
		p := contentStream{key: 42}
		last := 0
		for _, c := range append(cuts, len(whole)) {
			piece := make([]byte, c-last)
			p.fill(piece)
			got = append(got, piece...)
			last = c
		}
		if !bytes.Equal(got, whole) {
			t.Fatalf("cuts %v: the stream differs from one fill", cuts)
		}
	}
	// SplitMix64 seeded 42: its first output is 0xbdd732262feb6e95.
	if w := streamWord(42, 0); w != 0xbdd732262feb6e95 {
		t.Fatalf("first word %#x, want SplitMix64's 0xbdd732262feb6e95", w)
	}
	if whole[0] != 0x95 || whole[7] != 0xbd {
		t.Fatalf("first word not little-endian: % x", whole[:8])
	}
}
