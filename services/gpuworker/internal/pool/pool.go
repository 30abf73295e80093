// Package pool is one engine rank's paged KV memory as its gpuworker
// sees it: per KV group a number of blocks of bytes_per_block bytes, in a
// kvmem.Memory. Until the engine registers its own memory (a shared
// segment, or CUDA device memory) the pool allocates a heap memory of its
// own; Replace swaps in the registered one. Each block has its own lock, so
// the worker's loads, reads and puts of different blocks proceed in
// parallel and never see a block half written by each other.
//
// Every block carries its identity in its kvmem record: the chunk hash it
// holds, the request that wrote it (truncated to kvmem.RecordRequestIDLen),
// a write generation and when the write completed. The engine writes the
// blocks of a registered memory itself, by the same record protocol
// (kvmem's package doc), so a read checks the record twice: before the
// bytes are used it must hold exactly the asked hash, and after the use
// it must be unchanged; otherwise the read is refused (ErrNotHeld) and the
// caller discards what it made of the bytes. A block never written, evicted
// by the engine, rewritten for other content, torn by a failed write or
// rewritten during the read is never served.
package pool

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
)

// Sentinel errors.
var (
	// ErrOutOfRange reports a group or block id outside the pool.
	ErrOutOfRange = errors.New("block outside the pool")
	// ErrSize reports data whose length is not the group's bytes_per_block.
	ErrSize = errors.New("data size is not the block size")
	// ErrNotHeld reports a block that does not hold the asked hash.
	ErrNotHeld = errors.New("block does not hold the asked content")
)

// Tag is what one block holds.
type Tag struct {
	// Identity is the chunk hash and the writing request.
	dataplane.Identity
	// Generation is the write generation of the block's last write.
	// Generations start at the writer's start time in nanoseconds, so they
	// grow across restarts too.
	Generation uint64
}

// NotHeldError is an ErrNotHeld with what the block holds instead.
type NotHeldError struct {
	// Group and Block name the block.
	Group int
	Block kvcore.BlockID
	// Want is the asked hash.
	Want string
	// Held is what the block holds; its Hash is empty when nothing (or
	// while a write is in progress).
	Held Tag
	// Changed is set when the block held Want when the read began but its
	// record changed before the read was done: the bytes read are void.
	Changed bool
}

// Error describes the refusal.
func (e *NotHeldError) Error() string {
	reason := dataplane.NotHeldReason(e.Want, e.Held.Identity, e.Held.Generation)
	if e.Changed {
		reason = "rewritten, evicted or being written during the read: " + reason
	}
	return fmt.Sprintf("group %d block %d: %s", e.Group, e.Block, reason)
}

// Unwrap makes errors.Is(err, ErrNotHeld) hold.
func (e *NotHeldError) Unwrap() error { return ErrNotHeld }

// Pool is the paged KV memory of one engine rank.
type Pool struct {
	model *kvcore.Model
	gen   atomic.Uint64
	// mu guards mem and locks: every operation holds it for reading, Replace
	// for writing, so a replaced memory is closed only once no operation
	// uses it.
	mu    sync.RWMutex
	mem   kvmem.Memory
	locks [][]sync.RWMutex
	bpb   []int
}

// GroupStats describes one group's pool.
type GroupStats = adminapi.PoolGroup

// New allocates a heap memory of blocks blocks for every group of m. The
// operating system commits pages only when first written. No block holds
// anything until it is written.
func New(m *kvcore.Model, blocks int) (*Pool, error) {
	if blocks <= 0 {
		return nil, fmt.Errorf("pool of %d blocks: %w", blocks, ErrOutOfRange)
	}
	mem, err := kvmem.NewHeap(kvmem.ModelLayout(m, blocks))
	if err != nil {
		return nil, fmt.Errorf("pool memory: %w", err)
	}
	p := &Pool{model: m}
	p.gen.Store(uint64(time.Now().UnixNano()))
	p.bpb = make([]int, len(m.Groups))
	for i, g := range m.Groups {
		p.bpb[i] = int(g.BytesPerBlock)
	}
	p.install(mem)
	return p, nil
}

// install makes mem the pool's memory (the caller holds mu or owns p).
func (p *Pool) install(mem kvmem.Memory) {
	l := mem.Layout()
	p.mem = mem
	p.locks = make([][]sync.RWMutex, len(l.Groups))
	for g, gl := range l.Groups {
		p.locks[g] = make([]sync.RWMutex, gl.Blocks)
	}
}

// Replace makes mem (an engine's registered memory) the pool's memory once
// no operation uses the old one, and closes the old one: what its blocks
// held is gone with it, never served. mem's layout must fit the model
// (kvmem.Layout.Check).
func (p *Pool) Replace(mem kvmem.Memory) error {
	if err := mem.Layout().Check(p.model); err != nil {
		return err
	}
	p.mu.Lock()
	old := p.mem
	p.install(mem)
	p.mu.Unlock()
	if err := old.Close(); err != nil {
		return fmt.Errorf("close the replaced %s memory: %w", old.Kind(), err)
	}
	return nil
}

// MemoryKind is the kind of the pool's memory now (kvmem.KindHeap until an
// engine registered its own).
func (p *Pool) MemoryKind() string {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.mem.Kind()
}

// Blocks returns the number of blocks per group, for kvcore.ValidateSave.
func (p *Pool) Blocks() []int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	out := make([]int, len(p.locks))
	for i, l := range p.locks {
		out[i] = len(l)
	}
	return out
}

// BlockSize returns group's bytes_per_block, or an ErrOutOfRange error.
func (p *Pool) BlockSize(group int) (int, error) {
	if group < 0 || group >= len(p.bpb) {
		return 0, fmt.Errorf("group %d of %d: %w", group, len(p.bpb), ErrOutOfRange)
	}
	return p.bpb[group], nil
}

// Check reports whether (group, block) names a block of the pool.
func (p *Pool) Check(group int, block kvcore.BlockID) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.at(group, block)
}

// at checks (group, block) against the memory (the caller holds mu).
func (p *Pool) at(group int, block kvcore.BlockID) error {
	if group < 0 || group >= len(p.locks) {
		return fmt.Errorf("group %d of %d: %w", group, len(p.locks), ErrOutOfRange)
	}
	if n := len(p.locks[group]); block < 0 || int64(block) >= int64(n) {
		return fmt.Errorf("group %d block %d of %d: %w", group, block, n, ErrOutOfRange)
	}
	return nil
}

// Write fills one block with the content id names, by the record
// protocol: the record goes odd (holding nothing), fill gets the block's
// memory as one contiguous slice, and only when fill succeeds does the
// record hold id with a new generation. When fill fails the block may hold
// partial bytes and holds no identity; fill's error is returned. A block
// the engine is writing at the moment is refused (kvmem.ErrBusy).
func (p *Pool) Write(group int, block kvcore.BlockID, id dataplane.Identity, fill func(dst []byte) error) error {
	return p.WriteSegments(group, block, id, func(segs [][]byte) error {
		if len(segs) == 1 {
			return fill(segs[0])
		}
		buf := make([]byte, p.bpb[group])
		if err := fill(buf); err != nil {
			return err
		}
		at := 0
		for _, s := range segs {
			at += copy(s, buf[at:])
		}
		return nil
	})
}

// WriteSegments is Write with the block's regions: fill gets the block's
// memory as its regions in order.
func (p *Pool) WriteSegments(group int, block kvcore.BlockID, id dataplane.Identity, fill func(segs [][]byte) error) error {
	if err := id.Validate(); err != nil {
		return fmt.Errorf("group %d block %d: %w", group, block, err)
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if err := p.at(group, block); err != nil {
		return err
	}
	i := int(block)
	p.locks[group][i].Lock()
	defer p.locks[group][i].Unlock()
	rec := p.mem.Record(group, i)
	seq, err := rec.Begin(kvmem.WriterWorker)
	if err != nil {
		return fmt.Errorf("group %d block %d: %w", group, block, err)
	}
	if err := p.fill(group, i, fill); err != nil {
		rec.Abort(seq)
		return err
	}
	err = rec.Commit(seq, kvmem.Held{Hash: id.Hash, RequestID: id.RequestID, Generation: p.gen.Add(1),
		Completed: time.Now().UnixNano(), Writer: kvmem.WriterWorker})
	if err != nil {
		return fmt.Errorf("group %d block %d: %w", group, block, err)
	}
	return nil
}

// fill runs fill on the block's regions, staged in host memory when the
// memory is not host addressable.
func (p *Pool) fill(group, i int, fill func(segs [][]byte) error) error {
	if segs := p.mem.Regions(group, i); segs != nil {
		return fill(segs)
	}
	segs := kvmem.NewRegions(p.mem, group)
	if err := fill(segs); err != nil {
		return err
	}
	return p.mem.CopyIn(group, i, segs)
}

// WriteBytes copies data (exactly bytes_per_block long) into one block as
// the content id names.
func (p *Pool) WriteBytes(group int, block kvcore.BlockID, id dataplane.Identity, data []byte) error {
	bpb, err := p.BlockSize(group)
	if err != nil {
		return err
	}
	if len(data) != bpb {
		return fmt.Errorf("group %d: %d bytes for a %d-byte block: %w", group, len(data), bpb, ErrSize)
	}
	return p.WriteSegments(group, block, id, func(segs [][]byte) error {
		at := 0
		for _, s := range segs {
			at += copy(s, data[at:])
		}
		return nil
	})
}

// Read passes one block's memory (one contiguous slice: a block of several
// regions is gathered into a copy) and tag to use, provided the block
// holds hash want, and checks the record again after use: see
// ReadSegments. use must not keep the slice. An empty want is never held.
func (p *Pool) Read(group int, block kvcore.BlockID, want string, use func(src []byte, tag Tag) error) error {
	return p.ReadSegments(group, block, want, func(segs [][]byte, tag Tag) error {
		if len(segs) == 1 {
			return use(segs[0], tag)
		}
		buf := make([]byte, 0, p.bpb[group])
		for _, s := range segs {
			buf = append(buf, s...)
		}
		return use(buf, tag)
	})
}

// ReadSegments passes the block's bytes as its regions in order (one
// segment for a contiguous block), with its tag, after checking the block
// holds want; after use returns it checks the identity record again and
// returns a *NotHeldError (errors.Is ErrNotHeld) when the block was
// rewritten, evicted or is being written meanwhile — the caller must then
// discard whatever it made from the bytes. use must not keep the slices;
// an empty want is never held. The worker's own writes of the block wait
// for the read; the engine's writes of a registered memory do not, and
// are caught by the second check.
func (p *Pool) ReadSegments(group int, block kvcore.BlockID, want string, use func(segs [][]byte, tag Tag) error) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if err := p.at(group, block); err != nil {
		return err
	}
	i := int(block)
	p.locks[group][i].RLock()
	defer p.locks[group][i].RUnlock()
	rec := p.mem.Record(group, i)
	seq, held, ok := rec.Load()
	if want == "" || !ok || held.Hash != want {
		return &NotHeldError{Group: group, Block: block, Want: want, Held: tagOf(held)}
	}
	segs := p.mem.Regions(group, i)
	if segs == nil { // device memory: staged through the host
		segs = kvmem.NewRegions(p.mem, group)
		if err := p.mem.CopyOut(group, i, segs); err != nil {
			return fmt.Errorf("group %d block %d: %w", group, block, err)
		}
	}
	err := use(segs, tagOf(held))
	if !rec.Unchanged(seq) {
		_, now, _ := rec.Load()
		return &NotHeldError{Group: group, Block: block, Want: want, Held: tagOf(now), Changed: true}
	}
	return err
}

// tagOf is the Tag of a record's content.
func tagOf(h kvmem.Held) Tag {
	if h.Hash == "" {
		return Tag{}
	}
	return Tag{Identity: dataplane.Identity{Hash: h.Hash, RequestID: h.RequestID}, Generation: h.Generation}
}

// Copy returns a copy of one block's bytes, provided it holds hash want
// before and after the copy.
func (p *Pool) Copy(group int, block kvcore.BlockID, want string) ([]byte, error) {
	var out []byte
	err := p.ReadSegments(group, block, want, func(segs [][]byte, _ Tag) error {
		out = make([]byte, 0, p.bpb[group])
		for _, s := range segs {
			out = append(out, s...)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Tag returns what one block holds (a zero Tag when nothing, or while a
// write is in progress).
func (p *Pool) Tag(group int, block kvcore.BlockID) (Tag, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if err := p.at(group, block); err != nil {
		return Tag{}, err
	}
	_, h, _ := p.mem.Record(group, int(block)).Load()
	return tagOf(h), nil
}

// Evict clears one block's identity (the engine dropped its content); it
// reports whether the block held one. The bytes stay but are never served.
// A block being written is left to its writer (it holds nothing now).
func (p *Pool) Evict(group int, block kvcore.BlockID) (bool, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if err := p.at(group, block); err != nil {
		return false, err
	}
	i := int(block)
	p.locks[group][i].Lock()
	defer p.locks[group][i].Unlock()
	return clearRecord(p.mem.Record(group, i)), nil
}

// clearRecord clears a record; it reports whether it held something.
func clearRecord(rec kvmem.Record) bool {
	_, h, ok := rec.Load()
	seq, err := rec.Begin(kvmem.WriterWorker)
	if err != nil {
		return false // a write is in progress: the block holds nothing now
	}
	rec.Abort(seq)
	return ok && h.Hash != ""
}

// Stats describes every group, in group order; in use counts the blocks
// whose records hold something.
func (p *Pool) Stats(m *kvcore.Model) []GroupStats {
	p.mu.RLock()
	defer p.mu.RUnlock()
	out := make([]GroupStats, len(p.locks))
	for g, locks := range p.locks {
		n, inUse := len(locks), 0
		for i := range n {
			if _, h, ok := p.mem.Record(g, i).Load(); ok && h.Hash != "" {
				inUse++
			}
		}
		out[g] = GroupStats{
			Group: g, Kind: m.Groups[g].Kind, Blocks: n,
			BytesPerBlock: int64(p.bpb[g]), BytesTotal: int64(n) * int64(p.bpb[g]),
			InUse: inUse,
		}
	}
	return out
}

// Reset clears every block's identity; the bytes stay but are never served.
func (p *Pool) Reset() {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for g, locks := range p.locks {
		for i := range locks {
			locks[i].Lock()
			clearRecord(p.mem.Record(g, i))
			locks[i].Unlock()
		}
	}
}
