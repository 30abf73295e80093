// Package pool is one engine rank's paged KV memory: one contiguous buffer
// per KV group, block i at i × bytes_per_block. Host memory stands in for GPU
// memory. Each block has its own lock, so loads, writes and puts of
// different blocks proceed in parallel and a reader never sees a block half
// written.
package pool

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Sentinel errors.
var (
	// ErrOutOfRange reports a group or block id outside the pool.
	ErrOutOfRange = errors.New("block outside the pool")
	// ErrSize reports data whose length is not the group's bytes_per_block.
	ErrSize = errors.New("data size is not the block size")
)

// Pool is the paged KV memory of one engine rank.
type Pool struct {
	groups []*group
}

type group struct {
	bpb     int
	mem     []byte
	locks   []sync.RWMutex
	written []atomic.Bool
	inUse   atomic.Int64
}

// GroupStats describes one group's pool.
type GroupStats struct {
	// Group is the KV-group index.
	Group int `json:"group"`
	// Kind is the group's attention kind.
	Kind kvcore.Kind `json:"kind"`
	// Blocks is the number of blocks.
	Blocks int `json:"blocks"`
	// BytesPerBlock is the size of one block.
	BytesPerBlock int64 `json:"bytes_per_block"`
	// BytesTotal is Blocks × BytesPerBlock.
	BytesTotal int64 `json:"bytes_total"`
	// InUse counts blocks written (by a write or a load) since start or the
	// last Reset.
	InUse int `json:"in_use"`
}

// New allocates blocks blocks for every group of m. The memory is allocated
// up front but the operating system commits pages only when first written.
func New(m *kvcore.Model, blocks int) (*Pool, error) {
	if blocks <= 0 {
		return nil, fmt.Errorf("pool of %d blocks: %w", blocks, ErrOutOfRange)
	}
	p := &Pool{groups: make([]*group, len(m.Groups))}
	for i, g := range m.Groups {
		bpb := int(g.BytesPerBlock)
		p.groups[i] = &group{
			bpb:     bpb,
			mem:     make([]byte, blocks*bpb),
			locks:   make([]sync.RWMutex, blocks),
			written: make([]atomic.Bool, blocks),
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

// Write fills one block: fill gets the block's memory under the block's
// write lock. When fill fails the block may hold partial bytes and is
// marked not in use; its error is returned.
func (p *Pool) Write(group int, block kvcore.BlockID, fill func(dst []byte) error) error {
	g, err := p.at(group, block)
	if err != nil {
		return err
	}
	i := int(block)
	g.locks[i].Lock()
	defer g.locks[i].Unlock()
	if err := fill(g.mem[i*g.bpb : (i+1)*g.bpb]); err != nil {
		g.mark(i, false)
		return err
	}
	g.mark(i, true)
	return nil
}

// WriteBytes copies data (exactly bytes_per_block long) into one block.
func (p *Pool) WriteBytes(group int, block kvcore.BlockID, data []byte) error {
	bpb, err := p.BlockSize(group)
	if err != nil {
		return err
	}
	if len(data) != bpb {
		return fmt.Errorf("group %d: %d bytes for a %d-byte block: %w", group, len(data), bpb, ErrSize)
	}
	return p.Write(group, block, func(dst []byte) error {
		copy(dst, data)
		return nil
	})
}

// Read passes one block's memory to use under the block's read lock; use
// must not keep the slice.
func (p *Pool) Read(group int, block kvcore.BlockID, use func(src []byte) error) error {
	g, err := p.at(group, block)
	if err != nil {
		return err
	}
	i := int(block)
	g.locks[i].RLock()
	defer g.locks[i].RUnlock()
	return use(g.mem[i*g.bpb : (i+1)*g.bpb])
}

// Copy returns a copy of one block's bytes.
func (p *Pool) Copy(group int, block kvcore.BlockID) ([]byte, error) {
	var out []byte
	err := p.Read(group, block, func(src []byte) error {
		out = append([]byte(nil), src...)
		return nil
	})
	return out, err
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

// Reset marks every block not in use; the bytes stay.
func (p *Pool) Reset() {
	for _, g := range p.groups {
		for i := range g.written {
			g.mark(i, false)
		}
	}
}

// mark records whether block i holds written bytes, keeping the in-use count.
func (g *group) mark(i int, written bool) {
	if g.written[i].Swap(written) != written {
		if written {
			g.inUse.Add(1)
		} else {
			g.inUse.Add(-1)
		}
	}
}
