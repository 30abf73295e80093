// Package pool is one engine rank's paged KV memory: one contiguous buffer
// per KV group, block i at i × bytes_per_block. Host memory stands in for GPU
// memory. Each block has its own lock, so loads, writes and puts of
// different blocks proceed in parallel and a reader never sees a block half
// written.
//
// Every block carries its identity: the chunk hash it holds, the request
// that wrote it and a write generation. A write clears the identity before
// the first byte changes and records the new one only once the last byte is
// in; every read names the hash it expects and is refused (ErrNotHeld)
// unless the block holds exactly that, so a block never written since the
// worker started, evicted by the engine, rewritten for other content or
// torn by a failed write is never served.
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
	// Generation is the pool-wide write generation of the block's last
	// write. Generations start at the worker's start time in nanoseconds,
	// so they grow across restarts too.
	Generation uint64
}

// NotHeldError is an ErrNotHeld with what the block holds instead.
type NotHeldError struct {
	// Group and Block name the block.
	Group int
	Block kvcore.BlockID
	// Want is the asked hash.
	Want string
	// Held is what the block holds; its Hash is empty when nothing.
	Held Tag
}

// Error describes the refusal.
func (e *NotHeldError) Error() string {
	return fmt.Sprintf("group %d block %d: %s", e.Group, e.Block, dataplane.NotHeldReason(e.Want, e.Held.Identity, e.Held.Generation))
}

// Unwrap makes errors.Is(err, ErrNotHeld) hold.
func (e *NotHeldError) Unwrap() error { return ErrNotHeld }

// Pool is the paged KV memory of one engine rank.
type Pool struct {
	groups []*group
	gen    atomic.Uint64
}

type group struct {
	bpb   int
	mem   []byte
	locks []sync.RWMutex
	// tags[i] is guarded by locks[i]; a zero Hash means nothing is held.
	tags  []Tag
	inUse atomic.Int64
}

// GroupStats describes one group's pool.
type GroupStats = adminapi.PoolGroup

// New allocates blocks blocks for every group of m. The memory is allocated
// up front but the operating system commits pages only when first written.
// No block holds anything until it is written.
func New(m *kvcore.Model, blocks int) (*Pool, error) {
	if blocks <= 0 {
		return nil, fmt.Errorf("pool of %d blocks: %w", blocks, ErrOutOfRange)
	}
	p := &Pool{groups: make([]*group, len(m.Groups))}
	p.gen.Store(uint64(time.Now().UnixNano()))
	for i, g := range m.Groups {
		bpb := int(g.BytesPerBlock)
		p.groups[i] = &group{
			bpb:   bpb,
			mem:   make([]byte, blocks*bpb),
			locks: make([]sync.RWMutex, blocks),
			tags:  make([]Tag, blocks),
		}
	}
	return p, nil
}

// Blocks returns the number of blocks per group, for kvcore.ValidateSave.
func (p *Pool) Blocks() []int {
	out := make([]int, len(p.groups))
	for i, g := range p.groups {
		out[i] = len(g.locks)
	}
	return out
}

// BlockSize returns group's bytes_per_block, or an ErrOutOfRange error.
func (p *Pool) BlockSize(group int) (int, error) {
	if group < 0 || group >= len(p.groups) {
		return 0, fmt.Errorf("group %d of %d: %w", group, len(p.groups), ErrOutOfRange)
	}
	return p.groups[group].bpb, nil
}

// Check reports whether (group, block) names a block of the pool.
func (p *Pool) Check(group int, block kvcore.BlockID) error {
	_, err := p.at(group, block)
	return err
}

func (p *Pool) at(group int, block kvcore.BlockID) (*group, error) {
	if group < 0 || group >= len(p.groups) {
		return nil, fmt.Errorf("group %d of %d: %w", group, len(p.groups), ErrOutOfRange)
	}
	g := p.groups[group]
	if block < 0 || int64(block) >= int64(len(g.locks)) {
		return nil, fmt.Errorf("group %d block %d of %d: %w", group, block, len(g.locks), ErrOutOfRange)
	}
	return g, nil
}

// Write fills one block with the content id names: under the block's write
// lock its identity is cleared, fill gets the block's memory, and only when
// fill succeeds is id recorded with a new generation. When fill fails the
// block may hold partial bytes and holds no identity; fill's error is
// returned.
func (p *Pool) Write(group int, block kvcore.BlockID, id dataplane.Identity, fill func(dst []byte) error) error {
	if err := id.Validate(); err != nil {
		return fmt.Errorf("group %d block %d: %w", group, block, err)
	}
	g, err := p.at(group, block)
	if err != nil {
		return err
	}
	i := int(block)
	g.locks[i].Lock()
	defer g.locks[i].Unlock()
	g.set(i, Tag{})
	if err := fill(g.mem[i*g.bpb : (i+1)*g.bpb]); err != nil {
		return err
	}
	g.set(i, Tag{Identity: id, Generation: p.gen.Add(1)})
	return nil
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
	return p.Write(group, block, id, func(dst []byte) error {
		copy(dst, data)
		return nil
	})
}

// Read passes one block's memory and tag to use under the block's read
// lock, provided the block holds hash want; otherwise it returns a
// *NotHeldError (errors.Is ErrNotHeld) and use is not called. use must not
// keep the slice. An empty want is never held.
func (p *Pool) Read(group int, block kvcore.BlockID, want string, use func(src []byte, tag Tag) error) error {
	g, err := p.at(group, block)
	if err != nil {
		return err
	}
	i := int(block)
	g.locks[i].RLock()
	defer g.locks[i].RUnlock()
	tag := g.tags[i]
	if want == "" || tag.Hash != want {
		return &NotHeldError{Group: group, Block: block, Want: want, Held: tag}
	}
	return use(g.mem[i*g.bpb:(i+1)*g.bpb], tag)
}

// Copy returns a copy of one block's bytes, provided it holds hash want.
func (p *Pool) Copy(group int, block kvcore.BlockID, want string) ([]byte, error) {
	var out []byte
	err := p.Read(group, block, want, func(src []byte, _ Tag) error {
		out = append([]byte(nil), src...)
		return nil
	})
	return out, err
}

// Tag returns what one block holds (a zero Tag when nothing).
func (p *Pool) Tag(group int, block kvcore.BlockID) (Tag, error) {
	g, err := p.at(group, block)
	if err != nil {
		return Tag{}, err
	}
	i := int(block)
	g.locks[i].RLock()
	defer g.locks[i].RUnlock()
	return g.tags[i], nil
}

// Evict clears one block's identity (the engine dropped its content); it
// reports whether the block held one. The bytes stay but are never served.
func (p *Pool) Evict(group int, block kvcore.BlockID) (bool, error) {
	g, err := p.at(group, block)
	if err != nil {
		return false, err
	}
	i := int(block)
	g.locks[i].Lock()
	defer g.locks[i].Unlock()
	held := g.tags[i].Hash != ""
	g.set(i, Tag{})
	return held, nil
}

// Stats describes every group, in group order.
func (p *Pool) Stats(m *kvcore.Model) []GroupStats {
	out := make([]GroupStats, len(p.groups))
	for i, g := range p.groups {
		n := len(g.locks)
		out[i] = GroupStats{
			Group: i, Kind: m.Groups[i].Kind, Blocks: n,
			BytesPerBlock: int64(g.bpb), BytesTotal: int64(n) * int64(g.bpb),
			InUse: int(g.inUse.Load()),
		}
	}
	return out
}

// Reset clears every block's identity; the bytes stay but are never served.
func (p *Pool) Reset() {
	for _, g := range p.groups {
		for i := range g.tags {
			g.locks[i].Lock()
			g.set(i, Tag{})
			g.locks[i].Unlock()
		}
	}
}

// set records block i's tag (the caller holds its write lock), keeping the
// in-use count.
func (g *group) set(i int, t Tag) {
	was, is := g.tags[i].Hash != "", t.Hash != ""
	g.tags[i] = t
	switch {
	case is && !was:
		g.inUse.Add(1)
	case was && !is:
		g.inUse.Add(-1)
	}
}
