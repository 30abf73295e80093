package pool_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

func model(t *testing.T) *kvcore.Model {
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

// id is the identity of chunk hash h written by request req.
func id(h, req string) dataplane.Identity { return dataplane.Identity{Hash: h, RequestID: req} }

// hashOf is a chunk hash (lower-case hex) named by s.
func hashOf(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// contentOf is the n bytes a block holding hash h holds in these tests:
// the hash's bytes repeated, so bytes of another identity are recognisable.
func contentOf(h string, n int) []byte {
	raw, _ := hex.DecodeString(h)
	return bytes.Repeat(raw, n/len(raw)+1)[:n]
}

func TestWriteReadAndStats(t *testing.T) {
	m := model(t)
	p, err := pool.New(m, 4)
	if err != nil {
		t.Fatal(err)
	}
	h := hashOf("a")
	a := bytes.Repeat([]byte{0xaa}, 64)
	if err := p.WriteBytes(0, 2, id(h, "r1"), a); err != nil {
		t.Fatal(err)
	}
	if err := p.WriteBytes(0, 2, id(h, "r1"), a); err != nil { // rewriting counts once
		t.Fatal(err)
	}
	got, err := p.Copy(0, 2, h)
	if err != nil || !bytes.Equal(got, a) {
		t.Fatalf("Copy = %x, %v", got, err)
	}
	if tag, err := p.Tag(0, 3); err != nil || tag != (pool.Tag{}) {
		t.Fatalf("the next block holds %+v, %v", tag, err)
	}
	st := p.Stats(m)
	want := []pool.GroupStats{
		{Group: 0, Kind: kvcore.KindFullAttention, Blocks: 4, BytesPerBlock: 64, BytesTotal: 256, InUse: 1},
		{Group: 1, Kind: kvcore.KindMamba, Blocks: 4, BytesPerBlock: 32, BytesTotal: 128, InUse: 0},
	}
	for i := range want {
		if st[i] != want[i] {
			t.Fatalf("stats[%d] = %+v, want %+v", i, st[i], want[i])
		}
	}
	if got := p.Blocks(); len(got) != 2 || got[0] != 4 || got[1] != 4 {
		t.Fatalf("Blocks = %v", got)
	}
	p.Reset()
	if st := p.Stats(m); st[0].InUse != 0 {
		t.Fatalf("after Reset in use = %d", st[0].InUse)
	}
	if _, err := p.Copy(0, 2, h); !errors.Is(err, pool.ErrNotHeld) {
		t.Fatalf("Copy after Reset: %v, want ErrNotHeld", err)
	}
}

func TestRejects(t *testing.T) {
	p, err := pool.New(model(t), 4)
	if err != nil {
		t.Fatal(err)
	}
	ok := id(hashOf("x"), "r")
	tests := []struct {
		name  string
		group int
		block kvcore.BlockID
		id    dataplane.Identity
		data  []byte
		want  error
	}{
		{"group past the model", 2, 0, ok, make([]byte, 64), pool.ErrOutOfRange},
		{"negative group", -1, 0, ok, make([]byte, 64), pool.ErrOutOfRange},
		{"block past the pool", 0, 4, ok, make([]byte, 64), pool.ErrOutOfRange},
		{"null block", 0, kvcore.NullBlock, ok, make([]byte, 64), pool.ErrOutOfRange},
		{"short data", 0, 0, ok, make([]byte, 63), pool.ErrSize},
		{"long data", 1, 0, ok, make([]byte, 64), pool.ErrSize},
		{"no hash", 0, 0, id("", "r"), make([]byte, 64), dataplane.ErrIdentity},
		{"hash too long", 0, 0, id(string(bytes.Repeat([]byte("a"), dataplane.MaxHashLen+1)), "r"), make([]byte, 64), dataplane.ErrIdentity},
		{"request id too long", 0, 0, id("ab", string(bytes.Repeat([]byte("r"), dataplane.MaxRequestIDLen+1))), make([]byte, 64), dataplane.ErrIdentity},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := p.WriteBytes(tc.group, tc.block, tc.id, tc.data); !errors.Is(err, tc.want) {
				t.Fatalf("WriteBytes error = %v, want %v", err, tc.want)
			}
		})
	}
	if tag, _ := p.Tag(0, 0); tag != (pool.Tag{}) {
		t.Fatalf("a rejected write left block 0 holding %+v", tag)
	}
	if _, err := pool.New(model(t), 0); !errors.Is(err, pool.ErrOutOfRange) {
		t.Fatalf("New(0 blocks) error = %v", err)
	}
	if _, err := p.Evict(0, 4); !errors.Is(err, pool.ErrOutOfRange) {
		t.Fatalf("Evict past the pool: %v", err)
	}
	if _, err := p.Tag(2, 0); !errors.Is(err, pool.ErrOutOfRange) {
		t.Fatalf("Tag of a group past the model: %v", err)
	}
	if err := p.Read(0, 4, "ab", func([]byte, pool.Tag) error { return nil }); !errors.Is(err, pool.ErrOutOfRange) {
		t.Fatalf("Read past the pool: %v", err)
	}
}

func TestFailedFillMarksBlockFree(t *testing.T) {
	m := model(t)
	p, _ := pool.New(m, 2)
	h := hashOf("first")
	if err := p.WriteBytes(1, 1, id(h, "r1"), make([]byte, 32)); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("connection lost")
	if err := p.Write(1, 1, id(hashOf("second"), "r2"), func(dst []byte) error { dst[0] = 1; return boom }); !errors.Is(err, boom) {
		t.Fatalf("Write error = %v, want the fill's", err)
	}
	if st := p.Stats(m); st[1].InUse != 0 {
		t.Fatalf("a torn block counts as in use: %+v", st[1])
	}
}

// TestReadRefusesBlocksNotHeld walks a block through every way it can stop
// holding a hash and checks each read is refused with what it holds
// instead, never served.
func TestReadRefusesBlocksNotHeld(t *testing.T) {
	h1, h2 := hashOf("one"), hashOf("two")
	boom := errors.New("fill failed")
	write := func(p *pool.Pool, h, req string) {
		t.Helper()
		if err := p.WriteBytes(0, 1, id(h, req), contentOf(h, 64)); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name    string
		prepare func(p *pool.Pool)
		want    string             // the hash asked
		served  bool               // whether the read is served
		held    dataplane.Identity // what a refusal says the block holds
	}{
		{"never written", func(*pool.Pool) {}, h1, false, dataplane.Identity{}},
		{"written", func(p *pool.Pool) { write(p, h1, "r1") }, h1, true, dataplane.Identity{}},
		{"asked with an empty hash", func(p *pool.Pool) { write(p, h1, "r1") }, "", false, id(h1, "r1")},
		{"evicted", func(p *pool.Pool) {
			write(p, h1, "r1")
			if held, err := p.Evict(0, 1); err != nil || !held {
				t.Fatalf("Evict = %v, %v; want a held block", held, err)
			}
		}, h1, false, dataplane.Identity{}},
		{"reset", func(p *pool.Pool) { write(p, h1, "r1"); p.Reset() }, h1, false, dataplane.Identity{}},
		{"torn by a failed fill", func(p *pool.Pool) {
			write(p, h1, "r1")
			_ = p.Write(0, 1, id(h1, "r2"), func(dst []byte) error { copy(dst, "half"); return boom })
		}, h1, false, dataplane.Identity{}},
		{"rewritten with another hash", func(p *pool.Pool) { write(p, h1, "r1"); write(p, h2, "r2") }, h1, false, id(h2, "r2")},
		{"same hash rewritten by another request", func(p *pool.Pool) { write(p, h1, "r1"); write(p, h1, "r2") }, h1, true, dataplane.Identity{}},
		{"evicted then rewritten", func(p *pool.Pool) {
			write(p, h1, "r1")
			_, _ = p.Evict(0, 1)
			write(p, h1, "r3")
		}, h1, true, dataplane.Identity{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := pool.New(model(t), 2)
			tc.prepare(p)
			called := false
			err := p.Read(0, 1, tc.want, func(src []byte, tag pool.Tag) error {
				called = true
				if tag.Hash != tc.want || !bytes.Equal(src, contentOf(tc.want, 64)) {
					t.Errorf("served %+v with other bytes", tag)
				}
				return nil
			})
			if tc.served {
				if err != nil || !called {
					t.Fatalf("Read = %v (called %v), want the block served", err, called)
				}
				return
			}
			var nh *pool.NotHeldError
			if !errors.As(err, &nh) || !errors.Is(err, pool.ErrNotHeld) || called {
				t.Fatalf("Read = %v (called %v), want a NotHeldError", err, called)
			}
			if nh.Group != 0 || nh.Block != 1 || nh.Want != tc.want || nh.Held.Identity != tc.held {
				t.Fatalf("refusal %+v, want held %+v", nh, tc.held)
			}
			if (nh.Held.Generation == 0) != (tc.held.Hash == "") {
				t.Fatalf("refusal generation %d for held %+v", nh.Held.Generation, tc.held)
			}
			if _, err := p.Copy(0, 1, tc.want); !errors.Is(err, pool.ErrNotHeld) {
				t.Fatalf("Copy = %v, want ErrNotHeld", err)
			}
		})
	}
}

// TestGenerationGrows checks every successful write gets a generation above
// every earlier one, in any block and group, and that a new pool (a
// restarted worker) starts above the old one.
func TestGenerationGrows(t *testing.T) {
	m := model(t)
	p, _ := pool.New(m, 4)
	var last uint64
	writes := []struct {
		group int
		block kvcore.BlockID
	}{{0, 0}, {0, 0}, {1, 3}, {0, 2}, {1, 3}}
	for i, w := range writes {
		h := hashOf(fmt.Sprint(i))
		if err := p.WriteBytes(w.group, w.block, id(h, "r"), contentOf(h, int(m.Groups[w.group].BytesPerBlock))); err != nil {
			t.Fatal(err)
		}
		tag, err := p.Tag(w.group, w.block)
		if err != nil || tag.Hash != h || tag.RequestID != "r" {
			t.Fatalf("write %d: tag %+v, %v", i, tag, err)
		}
		if tag.Generation <= last {
			t.Fatalf("write %d: generation %d not above %d", i, tag.Generation, last)
		}
		last = tag.Generation
	}
	if _, err := p.Evict(0, 0); err != nil {
		t.Fatal(err)
	}
	if held, _ := p.Evict(0, 0); held {
		t.Fatal("a second Evict reports the block held")
	}
	if st := p.Stats(m); st[0].InUse != 1 || st[1].InUse != 1 {
		t.Fatalf("in use after eviction: %+v", st)
	}
	restarted, _ := pool.New(m, 4)
	h := hashOf("after")
	if err := restarted.WriteBytes(0, 0, id(h, "r"), contentOf(h, 64)); err != nil {
		t.Fatal(err)
	}
	if tag, _ := restarted.Tag(0, 0); tag.Generation <= last {
		t.Fatalf("a new pool's generation %d is not above the old one's %d", tag.Generation, last)
	}
}

// TestReadersNeverSeeTornBlocks has writers rewrite one block with several
// identities, each write's bytes derived from its hash, while readers ask
// for each hash in turn: every read served must carry exactly the bytes of
// the hash asked (no torn block, no bytes of another identity), and a
// refused read must say so.
func TestReadersNeverSeeTornBlocks(t *testing.T) {
	p, _ := pool.New(model(t), 2)
	hashes := []string{hashOf("a"), hashOf("b"), hashOf("c")}
	boom := errors.New("torn")
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				h := hashes[(i+w)%len(hashes)]
				if i%7 == 0 { // a fill that fails halfway
					_ = p.Write(0, 1, id(h, "torn"), func(dst []byte) error { copy(dst, contentOf(hashes[0], 32)); return boom })
					continue
				}
				if i%11 == 0 {
					_, _ = p.Evict(0, 1)
					continue
				}
				_ = p.WriteBytes(0, 1, id(h, fmt.Sprint("w", w)), contentOf(h, 64))
			}
		}()
	}
	bad := make(chan string, 1)
	var served, refused [2]int
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 1000 {
				want := hashes[(i+r)%len(hashes)]
				err := p.Read(0, 1, want, func(src []byte, tag pool.Tag) error {
					if tag.Hash != want || !bytes.Equal(src, contentOf(want, 64)) {
						select {
						case bad <- fmt.Sprintf("asked %s, served tag %+v with bytes %x", want, tag, src):
						default:
						}
					}
					return nil
				})
				switch {
				case err == nil:
					served[r]++
				case errors.Is(err, pool.ErrNotHeld):
					refused[r]++
				default:
					select {
					case bad <- fmt.Sprintf("read error %v", err):
					default:
					}
				}
			}
		}()
	}
	wg.Wait()
	select {
	case msg := <-bad:
		t.Fatal(msg)
	default:
	}
	for r := range 2 {
		if served[r]+refused[r] != 1000 {
			t.Fatalf("reader %d: %d served + %d refused of 1000", r, served[r], refused[r])
		}
	}
	// After the writers stop, the block holds the last write's hash or
	// nothing, and a read of it is served with that hash's bytes.
	tag, _ := p.Tag(0, 1)
	if tag.Hash != "" {
		if got, err := p.Copy(0, 1, tag.Hash); err != nil || !bytes.Equal(got, contentOf(tag.Hash, 64)) {
			t.Fatalf("final block %+v: %v", tag, err)
		}
	}
}
