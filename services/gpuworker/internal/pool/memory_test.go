package pool_test

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// engineMemory registers a segment of layout l with p and returns the
// engine's writer of it.
func engineMemory(t testing.TB, p *pool.Pool, l kvmem.Layout) *kvmem.EngineWriter {
	t.Helper()
	seg, err := kvmem.Create(filepath.Join(t.TempDir(), "engine.kvmem"), l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Remove() })
	peer, err := kvmem.Open(seg.Path(), l)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Replace(peer); err != nil {
		t.Fatal(err)
	}
	return kvmem.NewEngineWriter(seg)
}

// TestReplaceWithEngineMemory: blocks of the replaced memory are gone; the
// engine's blocks, in per-layer regions, read back whole and as segments;
// the worker's own writes land in the engine's memory under the record
// protocol; a block the engine is writing is refused to both.
func TestReplaceWithEngineMemory(t *testing.T) {
	m := model(t)
	p, err := pool.New(m, 4)
	if err != nil {
		t.Fatal(err)
	}
	h, g := hashOf("heap"), hashOf("engine")
	if err := p.WriteBytes(0, 1, id(h, "r"), contentOf(h, 64)); err != nil {
		t.Fatal(err)
	}
	l := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 6, Regions: []int64{16, 48}}, {Blocks: 6, Regions: []int64{32}}}}
	eng := engineMemory(t, p, l)
	if _, err := p.Copy(0, 1, h); !errors.Is(err, pool.ErrNotHeld) {
		t.Fatalf("a block of the replaced memory: %v, want ErrNotHeld", err)
	}
	if got := p.Blocks(); got[0] != 6 || p.MemoryKind() != kvmem.KindShm {
		t.Fatalf("blocks %v, kind %s after Replace", got, p.MemoryKind())
	}
	if err := eng.WriteBytes(0, 5, dataplane.Identity{Hash: g, RequestID: "e"}, contentOf(g, 64)); err != nil {
		t.Fatal(err)
	}
	if got, err := p.Copy(0, 5, g); err != nil || !bytes.Equal(got, contentOf(g, 64)) {
		t.Fatalf("Copy of the engine's block = %x, %v", got, err)
	}
	err = p.ReadSegments(0, 5, g, func(segs [][]byte, tag pool.Tag) error {
		if len(segs) != 2 || len(segs[0]) != 16 || len(segs[1]) != 48 || tag.RequestID != "e" {
			t.Errorf("segments %d, tag %+v", len(segs), tag)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	w := hashOf("worker")
	if err := p.WriteBytes(0, 2, id(w, "load"), contentOf(w, 64)); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(m); st[0].InUse != 2 || st[0].Blocks != 6 {
		t.Fatalf("stats %+v", st[0])
	}
	if held, err := eng.Evict(0, 2); err != nil || !held {
		t.Fatalf("the engine does not see the worker's write: %v, %v", held, err)
	}
	heap, err := kvmem.NewHeap(kvmem.ModelLayout(m, 6))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Replace(heap); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Copy(0, 5, g); !errors.Is(err, pool.ErrNotHeld) {
		t.Fatalf("after a second Replace the engine's block is still served: %v", err)
	}
	bad := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 6, Regions: []int64{64}}}}
	off, _ := kvmem.NewHeap(bad)
	if err := p.Replace(off); !errors.Is(err, kvmem.ErrLayout) {
		t.Fatalf("Replace with a layout off the model: %v", err)
	}
}

// TestWorkerWriteRefusedWhileEngineWrites: a block whose record shows the
// engine writing is neither served nor written by the worker.
func TestWorkerWriteRefusedWhileEngineWrites(t *testing.T) {
	m := model(t)
	p, _ := pool.New(m, 4)
	eng := engineMemory(t, p, kvmem.ModelLayout(m, 4))
	h := hashOf("x")
	err := eng.Write(0, 0, dataplane.Identity{Hash: h}, func(segs [][]byte) error {
		if err := p.WriteBytes(0, 0, id(h, "load"), contentOf(h, 64)); !errors.Is(err, kvmem.ErrBusy) {
			t.Errorf("worker write during the engine's: %v, want ErrBusy", err)
		}
		if _, err := p.Copy(0, 0, h); !errors.Is(err, pool.ErrNotHeld) {
			t.Errorf("read during the engine's write: %v, want ErrNotHeld", err)
		}
		copy(segs[0], contentOf(h, 64))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Copy(0, 0, h); err != nil {
		t.Fatalf("after the engine's write: %v", err)
	}
}

// BenchmarkReadSegments copies one 256 KiB block out of the pool (the
// put's and pd read's path), from the worker's heap and from an engine's
// shared segment.
func BenchmarkReadSegments(b *testing.B) {
	m, err := kvcore.ParseModel([]byte("name: bench\nhash_block_size: 16\ngroups:\n  - {kind: mamba, block_size: 16, bytes_per_block: 262144}\n"))
	if err != nil {
		b.Fatal(err)
	}
	h := hashOf("b")
	for _, kind := range []string{kvmem.KindHeap, kvmem.KindShm} {
		b.Run(kind, func(b *testing.B) {
			p, _ := pool.New(m, 4)
			if kind == kvmem.KindShm {
				engineMemory(b, p, kvmem.ModelLayout(m, 4))
			}
			if err := p.WriteBytes(0, 1, id(h, "r"), contentOf(h, 262144)); err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, 0, 262144)
			b.SetBytes(262144)
			for b.Loop() {
				err := p.ReadSegments(0, 1, h, func(segs [][]byte, _ pool.Tag) error {
					buf = buf[:0]
					for _, s := range segs {
						buf = append(buf, s...)
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
