package load

import (
	"context"
	"fmt"
	"io"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// pdItem is one block of a pd load: where it is read on the prefill
// engine's worker and where it goes in this pool.
type pdItem struct {
	group  int
	local  kvcore.BlockID
	remote kvcore.BlockID
	// hash is the chunk's hash: the remote block must hold it, and the
	// local block holds it once written.
	hash string
}

// planRemote maps each chunk of the task to its local and remote block.
// Chunks whose local block cannot be named are left out (there is nothing
// to report for them); chunks without a remote block are returned as
// errors.
func planRemote(m *kvcore.Model, task *kvcore.LoadTask) (items []pdItem, unmapped []kvcore.BlockID, err error) {
	if task.Model != m.Name {
		return nil, nil, fmt.Errorf("model %q, worker serves %q: %w", task.Model, m.Name, ErrNotPlanned)
	}
	for _, gc := range task.Groups {
		g := gc.Group
		if g < 0 || g >= len(m.Groups) || g >= len(task.BlockTable) {
			return nil, nil, fmt.Errorf("group %d outside the model or table: %w", g, ErrNotPlanned)
		}
		bs := m.Groups[g].BlockSize
		for _, c := range gc.Chunks {
			bi := c.BlockIndex(bs)
			if c.Start < 0 || c.Start%bs != 0 || c.End != c.Start+bs || bi >= len(task.BlockTable[g]) || task.BlockTable[g][bi] < 0 {
				return nil, nil, fmt.Errorf("group %d chunk [%d,%d) has no local block: %w", g, c.Start, c.End, ErrNotPlanned)
			}
			local := task.BlockTable[g][bi]
			hi := c.HashIndex(m.HashBlockSize)
			if hi >= len(task.BlockHashes) || !kvcore.IsHashHex(task.BlockHashes[hi]) {
				return nil, nil, fmt.Errorf("group %d chunk [%d,%d) has no valid hash at index %d: %w", g, c.Start, c.End, hi, ErrNotPlanned)
			}
			remote := remoteBlock(task.Remote.BlockTable, g, bi)
			if remote < 0 {
				unmapped = append(unmapped, local)
				continue
			}
			items = append(items, pdItem{group: g, local: local, remote: remote, hash: task.BlockHashes[hi]})
		}
	}
	return items, unmapped, nil
}

// remoteBlock is the remote table's block at (g, bi), or NullBlock.
func remoteBlock(t kvcore.BlockTable, g, bi int) kvcore.BlockID {
	if g >= len(t) || bi >= len(t[g]) {
		return kvcore.NullBlock
	}
	return t[g][bi]
}

// loadRemote reads the task's blocks from the prefill engine's worker of
// the same rank into the pool, in sub-batches, Streams of them at once.
func (l *Loader) loadRemote(ctx context.Context, task *kvcore.LoadTask) outcome {
	items, unmapped, err := planRemote(l.cfg.Model, task)
	if err != nil {
		return unplanned(l.cfg.Model, task, err)
	}
	res := outcome{failed: newBlockSet(nil)}
	for _, b := range unmapped {
		res.fail(b, fmt.Errorf("block %d has no block in the remote table: %w", b, ErrNotPlanned))
	}
	client, err := l.cfg.Remote(ctx, task.Remote.EngineID, l.cfg.Rank)
	if err != nil {
		for _, it := range items {
			res.fail(it.local, err)
		}
		return res
	}
	errs := make([]error, len(items))
	var written atomic.Int64
	var failed atomic.Bool
	l.eachBatch(len(items), func(i int) int64 { return l.cfg.Model.Groups[items[i].group].BytesPerBlock }, func(lo, hi int) {
		n, err := l.readBatch(ctx, client, task.RequestID, items[lo:hi], errs[lo:hi])
		written.Add(n)
		if err != nil {
			failed.Store(true)
		}
	})
	if failed.Load() && ctx.Err() == nil && l.cfg.RemoteFailed != nil {
		l.cfg.RemoteFailed(task.Remote.EngineID)
	}
	res.bytes = written.Load()
	for i, it := range items {
		if errs[i] != nil {
			res.fail(it.local, errs[i])
		}
	}
	return res
}

// readBatch reads one batch from the remote worker (each block's hash
// checked by the remote worker) straight into the pool: each frame's bytes
// are read into its pool block, and the block takes its identity only once
// the frame's checksum matched (a mismatch, or a stream that breaks inside
// it, leaves the block holding nothing). errs[i] records why item i failed
// (blocks the remote worker no longer holds included). It returns the
// bytes written, and the error that failed the read as a whole, if any.
func (l *Loader) readBatch(ctx context.Context, c *dataplane.Client, requestID string, items []pdItem, errs []error) (int64, error) {
	refs := make([]dataplane.ReadRef, len(items))
	for i, it := range items {
		refs[i] = dataplane.ReadRef{BlockRef: dataplane.BlockRef{Group: it.group, Block: it.remote}, Hash: it.hash}
	}
	var written int64
	done := make([]bool, len(items))
	err := c.ReadEach(ctx, refs, func(i int, b dataplane.ReadBlock, data *dataplane.FrameData) error {
		it := items[i]
		done[i] = true
		if b.NotHeld != "" {
			l.cfg.Metrics.NotHeld(metrics.OpLoadSource)
			errs[i] = fmt.Errorf("remote group %d block %d: %s: %w", it.group, it.remote, b.NotHeld, ErrSourceNotHeld)
			return nil
		}
		errs[i] = l.writeFrame(it, requestID, data)
		if errs[i] != nil && data.Verify() != nil {
			return errs[i] // the stream broke or lied inside this frame: the rest cannot be trusted
		}
		if errs[i] == nil {
			written += int64(data.Len())
		}
		return nil
	})
	if err != nil {
		for i := range errs {
			if !done[i] {
				errs[i] = err // never reached: the request or the stream failed before it
			}
		}
	}
	return written, err
}

// writeFrame reads a frame's bytes into its item's pool block and gives the block
// the item's identity once the bytes are whole and match their checksum.
func (l *Loader) writeFrame(it pdItem, requestID string, data *dataplane.FrameData) error {
	bpb, err := l.cfg.Pool.BlockSize(it.group)
	if err != nil {
		return err
	}
	if data.Len() != bpb {
		return fmt.Errorf("remote group %d block %d: %d bytes for a %d-byte block: %w", it.group, it.remote, data.Len(), bpb, pool.ErrSize)
	}
	return l.cfg.Pool.WriteSegments(it.group, it.local, dataplane.Identity{Hash: it.hash, RequestID: requestID}, func(segs [][]byte) error {
		for _, s := range segs {
			if _, err := io.ReadFull(data, s); err != nil {
				return err
			}
		}
		return data.Verify()
	})
}

// blockSet is an ordered set of block ids.
type blockSet struct {
	list []kvcore.BlockID
	seen map[kvcore.BlockID]bool
}

func newBlockSet(init []kvcore.BlockID) *blockSet {
	s := &blockSet{seen: map[kvcore.BlockID]bool{}}
	for _, b := range init {
		s.add(b)
	}
	return s
}

func (s *blockSet) add(b kvcore.BlockID) {
	if !s.seen[b] {
		s.seen[b] = true
		s.list = append(s.list, b)
	}
}
