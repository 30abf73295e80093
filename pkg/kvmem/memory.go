package kvmem

import (
	"fmt"
	"unsafe"
)

// Memory is the KV memory a gpuworker's pool moves bytes through: every
// block's identity record and its bytes.
type Memory interface {
	// Kind names the memory: KindHeap, KindShm or KindCUDA.
	Kind() string
	// Layout is the memory's layout.
	Layout() Layout
	// Record is the identity record of (group, block), both in range.
	Record(group, block int) Record
	// Regions returns the block's regions as host memory, in order, or
	// nil when the memory is not host addressable (device memory): then
	// CopyOut and CopyIn move the bytes.
	Regions(group, block int) [][]byte
	// CopyOut copies the block's regions into dst (one slice per region,
	// each its size).
	CopyOut(group, block int, dst [][]byte) error
	// CopyIn copies src (one slice per region) into the block.
	CopyIn(group, block int, src [][]byte) error
	// Close releases the memory; nothing of it may be used afterwards.
	Close() error
}

// The memory kinds.
const (
	KindHeap = "heap"
	KindShm  = "shm"
	KindCUDA = "cuda_ipc"
)

// host is a Memory in host memory: the records and the data tensors as
// slices of one buffer (heap) or one mapping (a segment).
type host struct {
	layout  Layout
	records [][]uint64 // records[g]: group g's records, recordWords a block
	data    [][][]byte // data[g][r]: group g's region-r tensor
}

// newHost lays layout out over buf (Offsets(layout).Size bytes, 8-byte
// aligned).
func newHost(l Layout, buf []byte) *host {
	o := l.Offsets()
	h := &host{layout: l, records: make([][]uint64, len(l.Groups)), data: make([][][]byte, len(l.Groups))}
	for g, gl := range l.Groups {
		n := int64(gl.Blocks) * RecordSize
		h.records[g] = records(buf[o.Records[g] : o.Records[g]+n : o.Records[g]+n])
		h.data[g] = make([][]byte, len(gl.Regions))
		for r, size := range gl.Regions {
			end := o.Data[g][r] + int64(gl.Blocks)*size
			h.data[g][r] = buf[o.Data[g][r]:end:end]
		}
	}
	return h
}

// Layout is the memory's layout.
func (h *host) Layout() Layout { return h.layout }

// Record is (group, block)'s record.
func (h *host) Record(group, block int) Record { return recordAt(h.records[group], block) }

// Regions are the block's regions.
func (h *host) Regions(group, block int) [][]byte {
	gl := h.layout.Groups[group]
	out := make([][]byte, len(gl.Regions))
	for r, size := range gl.Regions {
		at := int64(block) * size
		out[r] = h.data[group][r][at : at+size : at+size]
	}
	return out
}

// CopyOut copies the block's regions into dst.
func (h *host) CopyOut(group, block int, dst [][]byte) error {
	src := h.Regions(group, block)
	if err := sameShape(src, dst); err != nil {
		return err
	}
	for r := range src {
		copy(dst[r], src[r])
	}
	return nil
}

// CopyIn copies src into the block's regions.
func (h *host) CopyIn(group, block int, src [][]byte) error {
	dst := h.Regions(group, block)
	if err := sameShape(dst, src); err != nil {
		return err
	}
	for r := range dst {
		copy(dst[r], src[r])
	}
	return nil
}

// sameShape checks that b has a's regions' sizes.
func sameShape(a, b [][]byte) error {
	if len(a) != len(b) {
		return fmt.Errorf("%d regions for a block of %d: %w", len(b), len(a), ErrRange)
	}
	for r := range a {
		if len(a[r]) != len(b[r]) {
			return fmt.Errorf("region %d: %d bytes for %d: %w", r, len(b[r]), len(a[r]), ErrRange)
		}
	}
	return nil
}

// Heap is a Memory in the gpuworker's own heap: what the pool uses until
// an engine registers its memory.
type Heap struct{ *host }

// NewHeap allocates a heap memory of layout l. The operating system
// commits its pages only when first written.
func NewHeap(l Layout) (*Heap, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	size := l.Offsets().Size
	words := make([]uint64, size/8) // 8-byte aligned for the records' atomics
	buf := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), size)
	return &Heap{host: newHost(l, buf)}, nil
}

// Kind is KindHeap.
func (*Heap) Kind() string { return KindHeap }

// Close lets the garbage collector have the memory.
func (*Heap) Close() error { return nil }

// BlockBytes is the bytes of one block of group g of m (the sum of its
// regions).
func BlockBytes(m Memory, group int) int {
	return int(m.Layout().Groups[group].BlockBytes())
}

// NewRegions allocates one block's regions of group g of m, for staging.
func NewRegions(m Memory, group int) [][]byte {
	gl := m.Layout().Groups[group]
	buf := make([]byte, gl.BlockBytes())
	return Split(buf, gl.Regions)
}

// Split cuts a contiguous block buf into regions of the given sizes.
func Split(buf []byte, regions []int64) [][]byte {
	out := make([][]byte, len(regions))
	at := int64(0)
	for r, size := range regions {
		out[r] = buf[at : at+size : at+size]
		at += size
	}
	return out
}
