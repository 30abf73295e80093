package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
)

// The KV memory modes (Config.KVMemory): how computed KV reaches a rank's
// gpuworker.
const (
	// KVMemoryAuto is KVMemoryShm for every gpuworker on this host (a
	// loopback URL) that accepts the registration, KVMemoryHTTP for the
	// others (remote, without the route, or unable to map the segment).
	KVMemoryAuto = ""
	// KVMemoryHTTP writes every block over the data plane's write route.
	KVMemoryHTTP = "http"
	// KVMemoryShm gives every rank a shared-memory segment the engine owns,
	// registered with its gpuworker: computed KV goes straight into it.
	KVMemoryShm = "shm"
)

// rankMemory is the KV memory one rank's engine side owns: a segment
// registered with the rank's gpuworker.
type rankMemory struct {
	seg *kvmem.Segment
	w   *kvmem.EngineWriter
	reg kvmem.Registration
}

// checkKVMemory checks Config.KVMemory.
func checkKVMemory(mode string) error {
	switch mode {
	case KVMemoryAuto, KVMemoryHTTP, KVMemoryShm:
		return nil
	}
	return fmt.Errorf("kv memory %q: want %q or %q: %w", mode, KVMemoryHTTP, KVMemoryShm, ErrConfig)
}

// attachMemory gives the engines' ranks their KV memory as Config.KVMemory
// says: a segment per rank, registered with its gpuworker. The returned
// function removes every segment; it must be called when the run ends
// (also after an error).
func (r *run) attachMemory(ctx context.Context) (func(), error) {
	var mems []*rankMemory
	cleanup := func() {
		for _, m := range mems {
			_ = m.seg.Remove() // best effort: the run is over
		}
	}
	mode := r.cfg.KVMemory
	if mode == KVMemoryHTTP {
		return cleanup, nil
	}
	for _, e := range r.engines {
		for _, rw := range e.ranks {
			if mode == KVMemoryAuto && !loopback(rw.url) {
				continue
			}
			m, err := r.newRankMemory(ctx, e.id, rw)
			if m != nil {
				mems = append(mems, m)
			}
			switch {
			case err != nil && mode == KVMemoryAuto:
				// A worker without the route, or one that cannot map the
				// segment (another host or mount namespace, e.g. a
				// container): written over HTTP.
				if !errors.Is(err, kvmem.ErrNoRoute) {
					r.cfg.Log.Warn("gpuworker cannot map the engine's kv memory; writing over http", "engine", e.id, "rank", rw.label(), "err", err)
				}
				continue
			case err != nil:
				cleanup()
				return func() {}, fmt.Errorf("engine %s rank %s: kv memory: %w", e.id, rw.label(), err)
			}
			rw.mem = m
		}
	}
	return cleanup, nil
}

// newRankMemory creates rank rw's segment and registers it. The segment is
// returned (for cleanup) even when the registration failed. It has as many
// blocks per group as the worker's pool (at least the engine's PoolBlocks,
// which workers capped), so registering it changes no block id's range
// for anyone else using the worker.
func (r *run) newRankMemory(ctx context.Context, engineID string, rw *rankWorker) (*rankMemory, error) {
	ctx = withEngine(ctx, engineID)
	info, err := workerPool(ctx, r.cfg.HTTPClient, rw.url)
	if err != nil {
		return nil, err
	}
	l := kvmem.ModelLayout(r.cfg.Model, r.cfg.Engine.PoolBlocks)
	for g := range l.Groups {
		if g < len(info.Groups) && info.Groups[g].Blocks > l.Groups[g].Blocks {
			l.Groups[g].Blocks = info.Groups[g].Blocks
		}
	}
	name := fmt.Sprintf("kvmesh-%s-%d-%s-%s.kvmem", r.cfg.RunTag, os.Getpid(), engineID, rw.label())
	path := filepath.Join(kvmem.ShmDir(), safeName(name))
	seg, err := kvmem.Create(path, l)
	if err != nil {
		return nil, err
	}
	m := &rankMemory{seg: seg, w: kvmem.NewEngineWriter(seg), reg: kvmem.Registration{Kind: kvmem.KindShm, Path: path, Layout: l}}
	_, err = kvmem.Register(ctx, r.cfg.HTTPClient, rw.url, m.reg)
	return m, err
}

// safeName replaces what a file name should not hold.
func safeName(s string) string {
	return strings.Map(func(c rune) rune {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '-', c == '_':
			return c
		}
		return '_'
	}, s)
}

// loopback reports whether a gpuworker URL names this host.
func loopback(raw string) bool {
	u, err := url.Parse(raw)
	if err != nil {
		return false
	}
	host := u.Hostname()
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// ensure checks that the rank's gpuworker still has the segment
// registered and registers it again when not (the worker restarted: its
// pool is its own heap memory again). Records a dead worker left mid-load
// are cleared first. An unreachable worker is an error, retried by
// onRanks like any gpuworker call.
//
// The check is first the segment's liveness lock (kvmem.Segment.Mapped):
// the worker holds a shared flock on the segment for as long as it is its
// pool's memory, and the kernel drops it when the worker dies, so while
// the lock is held the registration stands and the worker is not asked.
// Only when nobody holds it (the worker died or restarted, or another
// registration replaced ours), or the filesystem has no flock, is the
// worker asked (GET /v1/kv-memory), as before. The segment is only ever
// made for a worker on this host (loopback), which can hold the lock.
func (m *rankMemory) ensure(ctx context.Context, hc *http.Client, base string) error {
	if mapped, err := m.seg.Mapped(); err == nil && mapped {
		return nil
	}
	cur, err := kvmem.Current(ctx, hc, base)
	if err != nil {
		return err
	}
	if cur.Kind == m.reg.Kind && cur.Path == m.reg.Path {
		return nil
	}
	m.w.RecoverWorkerWrites()
	_, err = kvmem.Register(ctx, hc, base, m.reg)
	return err
}

// write writes blocks straight into the segment, each by the identity
// record protocol: a block with Data is copied in (content shared with
// other ranks), one without has its content computed in place by
// compute(i, its regions). A block whose record shows the gpuworker
// writing it (a load into a block the engine computes: an engine bug) is
// an error.
func (m *rankMemory) write(blocks []dataplane.Block, compute func(i int, segs [][]byte)) error {
	for i, b := range blocks {
		var err error
		if b.Data != nil {
			err = m.w.WriteBytes(b.Group, int(b.Block), b.Identity, b.Data)
		} else {
			err = m.w.Write(b.Group, int(b.Block), b.Identity, func(segs [][]byte) error {
				compute(i, segs)
				return nil
			})
		}
		if err != nil {
			return fmt.Errorf("write group %d block %d into the kv memory: %w", b.Group, b.Block, err)
		}
	}
	return nil
}

// read copies blocks out of the segment by the reader's protocol: a block
// whose record does not hold the asked hash, or changed during the copy,
// is answered not held (lost), like the data plane's not-held frame.
func (m *rankMemory) read(refs []dataplane.ReadRef) []dataplane.ReadBlock {
	out := make([]dataplane.ReadBlock, len(refs))
	for i, ref := range refs {
		out[i].BlockRef = ref.BlockRef
		if err := kvmem.CheckBlock(m.seg.Layout(), ref.Group, int(ref.Block)); err != nil {
			out[i].NotHeld = err.Error()
			continue
		}
		rec := m.seg.Record(ref.Group, int(ref.Block))
		seq, held, ok := rec.Load()
		if !ok || held.Hash != ref.Hash {
			out[i].NotHeld = dataplane.NotHeldReason(ref.Hash, dataplane.Identity{Hash: held.Hash, RequestID: held.RequestID}, held.Generation)
			continue
		}
		var data []byte
		for _, s := range m.seg.Regions(ref.Group, int(ref.Block)) {
			data = append(data, s...)
		}
		if !rec.Unchanged(seq) {
			out[i].NotHeld = "rewritten during the read back"
			continue
		}
		out[i].Identity = dataplane.Identity{Hash: held.Hash, RequestID: held.RequestID}
		out[i].Generation, out[i].Data = held.Generation, data
	}
	return out
}

// evict clears the blocks' records; it returns how many held something.
func (m *rankMemory) evict(refs []dataplane.BlockRef) (int, error) {
	n := 0
	for _, ref := range refs {
		held, err := m.w.Evict(ref.Group, int(ref.Block))
		if err != nil {
			return n, fmt.Errorf("evict group %d block %d from the kv memory: %w", ref.Group, ref.Block, err)
		}
		if held {
			n++
		}
	}
	return n, nil
}
