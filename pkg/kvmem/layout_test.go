package kvmem

import (
	"bytes"
	"cmp"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func testModel(t *testing.T) *kvcore.Model {
	t.Helper()
	m, err := kvcore.ParseModel([]byte(`
name: tiny
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 64}
  - {kind: mamba, block_size: 16, bytes_per_block: 32}
`))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestLayoutCheck(t *testing.T) {
	m := testModel(t)
	tests := []struct {
		name   string
		layout Layout
		ok     bool
	}{
		{"one region per group", ModelLayout(m, 4), true},
		{"per-layer regions", Layout{Groups: []GroupLayout{{Blocks: 4, Regions: []int64{16, 16, 32}}, {Blocks: 2, Regions: []int64{32}}}}, true},
		{"no groups", Layout{}, false},
		{"a group short", Layout{Groups: []GroupLayout{{Blocks: 4, Regions: []int64{64}}}}, false},
		{"regions not summing to bytes_per_block", Layout{Groups: []GroupLayout{{Blocks: 4, Regions: []int64{16, 16}}, {Blocks: 4, Regions: []int64{32}}}}, false},
		{"no blocks", Layout{Groups: []GroupLayout{{Blocks: 0, Regions: []int64{64}}, {Blocks: 4, Regions: []int64{32}}}}, false},
		{"too many blocks", Layout{Groups: []GroupLayout{{Blocks: maxBlocks + 1, Regions: []int64{64}}, {Blocks: 4, Regions: []int64{32}}}}, false},
		{"no regions", Layout{Groups: []GroupLayout{{Blocks: 4}, {Blocks: 4, Regions: []int64{32}}}}, false},
		{"an empty region", Layout{Groups: []GroupLayout{{Blocks: 4, Regions: []int64{64, 0}}, {Blocks: 4, Regions: []int64{32}}}}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.layout.Check(m)
			if tc.ok != (err == nil) || err != nil && !errors.Is(err, ErrLayout) {
				t.Fatalf("Check = %v, want ok %v", err, tc.ok)
			}
		})
	}
}

// TestOffsetsDisjoint checks that records and tensors never overlap and
// that every tensor is page aligned.
func TestOffsetsDisjoint(t *testing.T) {
	l := Layout{Groups: []GroupLayout{{Blocks: 5, Regions: []int64{24, 40}}, {Blocks: 3, Regions: []int64{32}}}}
	o := l.Offsets()
	type span struct{ from, to int64 }
	spans := []span{{0, HeaderSize}}
	for g, gl := range l.Groups {
		spans = append(spans, span{o.Records[g], o.Records[g] + int64(gl.Blocks)*RecordSize})
		for r, size := range gl.Regions {
			if o.Data[g][r]%pageSize != 0 {
				t.Fatalf("tensor %d/%d at %d is not page aligned", g, r, o.Data[g][r])
			}
			spans = append(spans, span{o.Data[g][r], o.Data[g][r] + int64(gl.Blocks)*size})
		}
	}
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.from, b.from) })
	for i := 1; i < len(spans); i++ {
		if spans[i].from < spans[i-1].to {
			t.Fatalf("span %d %v overlaps %v", i, spans[i], spans[i-1])
		}
	}
	if last := spans[len(spans)-1]; o.Size < last.to {
		t.Fatalf("size %d below the last span's end %d", o.Size, last.to)
	}
}

// TestSegmentSharesBytes creates a segment, writes blocks of several
// regions as the engine, and reads them through a second mapping of the
// file as the gpuworker does.
func TestSegmentSharesBytes(t *testing.T) {
	l := Layout{Groups: []GroupLayout{{Blocks: 4, Regions: []int64{16, 16, 32}}, {Blocks: 2, Regions: []int64{32}}}}
	path := filepath.Join(t.TempDir(), "seg")
	seg, err := Create(path, l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Remove() })
	data := make([]byte, 64)
	for i := range data {
		data[i] = byte(i)
	}
	w := NewEngineWriter(seg)
	if err := w.WriteBytes(0, 3, dataplane.Identity{Hash: "aa", RequestID: "r"}, data); err != nil {
		t.Fatal(err)
	}
	peer, err := Open(path, l)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	seq, h, ok := peer.Record(0, 3).Load()
	if !ok || h.Hash != "aa" || h.RequestID != "r" || h.Writer != WriterEngine || h.Completed == 0 {
		t.Fatalf("the peer sees %+v (ok %v)", h, ok)
	}
	got := make([][]byte, 3)
	for r, s := range peer.Regions(0, 3) {
		got[r] = append([]byte(nil), s...)
	}
	if !peer.Record(0, 3).Unchanged(seq) || !bytes.Equal(bytes.Join(got, nil), data) {
		t.Fatalf("the peer read %x", bytes.Join(got, nil))
	}
	if _, h, _ := peer.Record(0, 2).Load(); h.Hash != "" {
		t.Fatalf("a block never written holds %+v", h)
	}
	if held, err := w.Evict(0, 3); err != nil || !held {
		t.Fatalf("Evict = %v, %v", held, err)
	}
	if _, h, _ := peer.Record(0, 3).Load(); h.Hash != "" {
		t.Fatalf("after the engine's eviction the peer sees %+v", h)
	}
}

func TestOpenRefuses(t *testing.T) {
	l := Layout{Groups: []GroupLayout{{Blocks: 4, Regions: []int64{64}}}}
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	seg, err := Create(good, l)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Remove()
	raw, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	badMagic := bytes.Clone(raw)
	copy(badMagic, "NOTASEGM")
	badVersion := bytes.Clone(raw)
	badVersion[8] = 9
	other := Layout{Groups: []GroupLayout{{Blocks: 5, Regions: []int64{64}}}}
	tests := []struct {
		name string
		path string
		want Layout
		err  error
	}{
		{"missing", filepath.Join(dir, "none"), l, os.ErrNotExist},
		{"bad magic", write("magic", badMagic), l, ErrSegment},
		{"bad version", write("version", badVersion), l, ErrSegment},
		{"too small", write("small", raw[:HeaderSize+RecordSize]), l, ErrSegment},
		{"empty", write("empty", nil), l, ErrSegment},
		{"another layout", good, other, ErrLayout},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Open(tc.path, tc.want)
			if err == nil {
				_ = s.Close()
			}
			if !errors.Is(err, tc.err) {
				t.Fatalf("Open = %v, want %v", err, tc.err)
			}
		})
	}
	if _, err := Create(good, l); !errors.Is(err, os.ErrExist) {
		t.Fatalf("Create over an existing file: %v", err)
	}
}
