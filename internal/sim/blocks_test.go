package sim

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func allocN(t *testing.T, p *blockPool, g, n int) []kvcore.BlockID {
	t.Helper()
	var out []kvcore.BlockID
	for range n {
		b, ok := p.alloc(g)
		if !ok {
			t.Fatalf("alloc %d of %d failed", len(out)+1, n)
		}
		out = append(out, b)
	}
	return out
}

// TestBlockPoolAllocUntilFull: a pool of 5 block ids hands out 4 real
// blocks, 1 to 4: block 0 is the null block (vLLM's BlockPool reserves it
// as null_block) and is never handed out.
func TestBlockPoolAllocUntilFull(t *testing.T) {
	p := newBlockPool(2, 5)
	if p.available(0) != 4 || usableBlocks(5) != 4 {
		t.Fatalf("available %d (usable %d), want 4: the null block is not available", p.available(0), usableBlocks(5))
	}
	got := allocN(t, p, 0, 4)
	seen := map[kvcore.BlockID]bool{}
	for _, b := range got {
		if b == nullBlockID || b < 1 || b >= 5 || seen[b] {
			t.Fatalf("handed out %v, want 1..4 each once", got)
		}
		seen[b] = true
	}
	if b, ok := p.alloc(0); ok || b != nullBlockID || p.available(0) != 0 {
		t.Fatalf("a full group handed out block %d (available %d)", b, p.available(0))
	}
	if p.available(1) != 4 {
		t.Fatalf("group 1 available %d, want 4: groups are separate", p.available(1))
	}
	if d := declaredNullBlockID(); d == nil || *d != 0 {
		t.Fatalf("declared null block id %v, want 0", d)
	}
}

func TestBlockPoolPrefixCacheLRU(t *testing.T) {
	p := newBlockPool(1, 4)
	bs := allocN(t, p, 0, 3)
	for i, key := range []string{"a", "b", "c"} {
		p.register(0, bs[i], key)
	}
	for _, b := range bs {
		p.release(0, b)
	}
	if p.available(0) != 3 {
		t.Fatalf("available %d after releasing all", p.available(0))
	}
	b, ok := p.cached(0, "b")
	if !ok || b != bs[1] {
		t.Fatalf("cached(b) = %v, %v", b, ok)
	}
	p.acquire(0, b) // a hit: b leaves the evictable list
	if p.available(0) != 2 {
		t.Fatalf("available %d after a hit, want 2", p.available(0))
	}
	first, _ := p.alloc(0) // evicts the least recently freed: a
	if first != bs[0] {
		t.Fatalf("evicted %d, want %d (a, freed first)", first, bs[0])
	}
	if _, ok := p.cached(0, "a"); ok {
		t.Fatal("an evicted block is still in the cache")
	}
	if _, ok := p.cached(0, "c"); !ok {
		t.Fatal("c was evicted before its turn")
	}
	p.release(0, b)
	if got, ok := p.cached(0, "b"); !ok || got != b || !p.reusable(0, b) {
		t.Fatal("b left the cache on release")
	}
}

func TestBlockPoolRegisterKeepsFirstHolder(t *testing.T) {
	p := newBlockPool(1, 3)
	bs := allocN(t, p, 0, 2)
	p.register(0, bs[0], "k")
	p.register(0, bs[1], "k")
	if b, _ := p.cached(0, "k"); b != bs[0] {
		t.Fatalf("cached(k) = %d, want the first holder %d", b, bs[0])
	}
	p.release(0, bs[0])
	if b, ok := p.alloc(0); !ok || b != bs[0] {
		t.Fatalf("alloc = %d, %v; want the released block %d", b, ok, bs[0])
	}
	if _, ok := p.cached(0, "k"); ok {
		t.Fatal("contents of a reused block still cached")
	}
}

func TestBlockPoolPins(t *testing.T) {
	p := newBlockPool(1, 3)
	bs := allocN(t, p, 0, 2)
	p.register(0, bs[0], "saved")
	p.pin(0, bs[0]) // a save reads it
	p.pin(0, bs[1])
	p.release(0, bs[0])
	p.release(0, bs[1])
	if p.available(0) != 0 {
		t.Fatalf("pinned blocks count as available (%d)", p.available(0))
	}
	if b, ok := p.alloc(0); ok {
		t.Fatalf("handed out pinned block %d", b)
	}
	p.unpin(0, bs[1])
	if b, ok := p.alloc(0); !ok || b != bs[1] {
		t.Fatalf("after unpin: %d, %v; want %d", b, ok, bs[1])
	}
	if p.reusable(0, bs[0]) {
		t.Fatal("a pinned block is reusable")
	}
	p.acquire(0, bs[0]) // a cache hit on a pinned block is fine
	p.unpin(0, bs[0])
	if p.available(0) != 0 || p.inUse(0) != 2 {
		t.Fatalf("available %d in use %d; want 0 and 2", p.available(0), p.inUse(0))
	}
}
