package pool_test

import (
	"bytes"
	"errors"
	"sync"
	"testing"

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

func TestWriteReadAndStats(t *testing.T) {
	m := model(t)
	p, err := pool.New(m, 4)
	if err != nil {
		t.Fatal(err)
	}
	a := bytes.Repeat([]byte{0xaa}, 64)
	if err := p.WriteBytes(0, 2, a); err != nil {
		t.Fatal(err)
	}
	if err := p.WriteBytes(0, 2, a); err != nil { // rewriting counts once
		t.Fatal(err)
	}
	got, err := p.Copy(0, 2)
	if err != nil || !bytes.Equal(got, a) {
		t.Fatalf("Copy = %x, %v", got, err)
	}
	if neighbour, _ := p.Copy(0, 3); !bytes.Equal(neighbour, make([]byte, 64)) {
		t.Fatalf("the next block changed: %x", neighbour)
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
	if got, _ := p.Copy(0, 2); !bytes.Equal(got, a) {
		t.Fatal("Reset changed the bytes")
	}
}

func TestRejects(t *testing.T) {
	p, err := pool.New(model(t), 4)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		group int
		block kvcore.BlockID
		data  []byte
		want  error
	}{
		{"group past the model", 2, 0, make([]byte, 64), pool.ErrOutOfRange},
		{"negative group", -1, 0, make([]byte, 64), pool.ErrOutOfRange},
		{"block past the pool", 0, 4, make([]byte, 64), pool.ErrOutOfRange},
		{"null block", 0, kvcore.NullBlock, make([]byte, 64), pool.ErrOutOfRange},
		{"short data", 0, 0, make([]byte, 63), pool.ErrSize},
		{"long data", 1, 0, make([]byte, 64), pool.ErrSize},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := p.WriteBytes(tc.group, tc.block, tc.data); !errors.Is(err, tc.want) {
				t.Fatalf("WriteBytes error = %v, want %v", err, tc.want)
			}
		})
	}
	if _, err := pool.New(model(t), 0); !errors.Is(err, pool.ErrOutOfRange) {
		t.Fatalf("New(0 blocks) error = %v", err)
	}
}

func TestFailedFillMarksBlockFree(t *testing.T) {
	m := model(t)
	p, _ := pool.New(m, 2)
	if err := p.WriteBytes(1, 1, make([]byte, 32)); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("connection lost")
	if err := p.Write(1, 1, func(dst []byte) error { dst[0] = 1; return boom }); !errors.Is(err, boom) {
		t.Fatalf("Write error = %v, want the fill's", err)
	}
	if st := p.Stats(m); st[1].InUse != 0 {
		t.Fatalf("a torn block counts as in use: %+v", st[1])
	}
}

// TestReadersNeverSeeTornBlocks writes whole blocks of one repeated byte
// while readers check that every block they see is uniform.
func TestReadersNeverSeeTornBlocks(t *testing.T) {
	p, _ := pool.New(model(t), 2)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range 500 {
			_ = p.WriteBytes(0, 1, bytes.Repeat([]byte{byte(i)}, 64))
		}
	}()
	torn := make(chan []byte, 1)
	go func() {
		defer wg.Done()
		for range 500 {
			_ = p.Read(0, 1, func(src []byte) error {
				if !bytes.Equal(src, bytes.Repeat(src[:1], len(src))) {
					select {
					case torn <- append([]byte(nil), src...):
					default:
					}
				}
				return nil
			})
		}
	}()
	wg.Wait()
	select {
	case b := <-torn:
		t.Fatalf("a reader saw a torn block: %x", b)
	default:
	}
}
