package kvmem

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Magic opens every segment; Version is the format this package writes.
const (
	Magic   = "KVMEMSEG"
	Version = 1
)

// HeaderSize is the bytes before the records: magic, version, the
// layout's length and the layout as JSON.
const HeaderSize = 4096

// pageSize aligns every data tensor.
const pageSize = 4096

// maxBlocks bounds a group's blocks (a sanity bound: 2^24 blocks).
const maxBlocks = 1 << 24

// Layout describes a KV memory: per KV group, in group order, its blocks
// and the bytes of each region of a block.
type Layout struct {
	// Groups are the KV groups, in group-index order.
	Groups []GroupLayout `json:"groups"`
}

// GroupLayout is one group's part of a Layout.
type GroupLayout struct {
	// Blocks is the number of blocks (vLLM's num_blocks).
	Blocks int `json:"blocks"`
	// Regions are the bytes of each region of one block, in order: one per
	// layer tensor where the engine keeps one tensor per layer, a single
	// one for a contiguous block. Their sum is the group's bytes_per_block.
	Regions []int64 `json:"regions"`
}

// BlockBytes is the sum of the group's regions.
func (g GroupLayout) BlockBytes() int64 {
	var n int64
	for _, r := range g.Regions {
		n += r
	}
	return n
}

// ModelLayout is the layout of blocks blocks per group of m, one region
// per block.
func ModelLayout(m *kvcore.Model, blocks int) Layout {
	l := Layout{Groups: make([]GroupLayout, len(m.Groups))}
	for i, g := range m.Groups {
		l.Groups[i] = GroupLayout{Blocks: blocks, Regions: []int64{g.BytesPerBlock}}
	}
	return l
}

// Validate checks that the layout describes a memory: at least one group,
// each with 1..2^24 blocks and regions of positive size.
func (l Layout) Validate() error {
	if len(l.Groups) == 0 {
		return fmt.Errorf("no groups: %w", ErrLayout)
	}
	for i, g := range l.Groups {
		if g.Blocks < 1 || g.Blocks > maxBlocks {
			return fmt.Errorf("groups[%d]: %d blocks (1..%d): %w", i, g.Blocks, maxBlocks, ErrLayout)
		}
		if len(g.Regions) == 0 {
			return fmt.Errorf("groups[%d]: no regions: %w", i, ErrLayout)
		}
		for j, r := range g.Regions {
			if r < 1 || r > 1<<32 {
				return fmt.Errorf("groups[%d].regions[%d]: %d bytes: %w", i, j, r, ErrLayout)
			}
		}
	}
	return nil
}

// Check validates the layout and that it fits model m: the same number of
// groups, each block's regions summing to its group's bytes_per_block.
func (l Layout) Check(m *kvcore.Model) error {
	if err := l.Validate(); err != nil {
		return err
	}
	if len(l.Groups) != len(m.Groups) {
		return fmt.Errorf("%d groups for model %s of %d: %w", len(l.Groups), m.Name, len(m.Groups), ErrLayout)
	}
	for i, g := range l.Groups {
		if got, want := g.BlockBytes(), m.Groups[i].BytesPerBlock; got != want {
			return fmt.Errorf("groups[%d]: regions sum to %d bytes, model %s's bytes_per_block is %d: %w", i, got, m.Name, want, ErrLayout)
		}
	}
	return nil
}

// Equal reports whether two layouts are the same.
func (l Layout) Equal(o Layout) bool {
	a, _ := json.Marshal(l)
	b, _ := json.Marshal(o)
	return bytes.Equal(a, b)
}

// Offsets are where a layout's parts lie in its segment.
type Offsets struct {
	// Records[g] is the offset of group g's first record.
	Records []int64
	// Data[g][r] is the offset of group g's region-r tensor.
	Data [][]int64
	// Size is the segment's size.
	Size int64
}

// Offsets computes where the parts of a valid layout lie.
func (l Layout) Offsets() Offsets {
	o := Offsets{Records: make([]int64, len(l.Groups)), Data: make([][]int64, len(l.Groups))}
	at := int64(HeaderSize)
	for g, gl := range l.Groups {
		o.Records[g] = at
		at += int64(gl.Blocks) * RecordSize
	}
	for g, gl := range l.Groups {
		o.Data[g] = make([]int64, len(gl.Regions))
		for r, size := range gl.Regions {
			at = alignUp(at, pageSize)
			o.Data[g][r] = at
			at += int64(gl.Blocks) * size
		}
	}
	o.Size = alignUp(at, pageSize)
	return o
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// encodeHeader is the header of a segment of layout l.
func encodeHeader(l Layout) ([]byte, error) {
	js, err := json.Marshal(l)
	if err != nil {
		return nil, fmt.Errorf("encode layout: %w", err)
	}
	if 16+len(js) > HeaderSize {
		return nil, fmt.Errorf("layout of %d bytes of JSON over the %d-byte header: %w", len(js), HeaderSize-16, ErrLayout)
	}
	h := make([]byte, HeaderSize)
	copy(h, Magic)
	binary.LittleEndian.PutUint32(h[8:], Version)
	binary.LittleEndian.PutUint32(h[12:], uint32(len(js)))
	copy(h[16:], js)
	return h, nil
}

// decodeHeader is the layout a segment's header holds.
func decodeHeader(h []byte) (Layout, error) {
	var l Layout
	if len(h) < HeaderSize || string(h[:8]) != Magic {
		return l, fmt.Errorf("no %q magic: %w", Magic, ErrSegment)
	}
	if v := binary.LittleEndian.Uint32(h[8:]); v != Version {
		return l, fmt.Errorf("format version %d, this build reads %d: %w", v, Version, ErrSegment)
	}
	n := int(binary.LittleEndian.Uint32(h[12:]))
	if n > HeaderSize-16 {
		return l, fmt.Errorf("layout of %d bytes: %w", n, ErrSegment)
	}
	if err := json.Unmarshal(h[16:16+n], &l); err != nil {
		return l, fmt.Errorf("layout: %v: %w", err, ErrSegment)
	}
	if err := l.Validate(); err != nil {
		return l, fmt.Errorf("%w: %w", ErrSegment, err)
	}
	return l, nil
}
