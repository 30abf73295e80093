package registry

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestPlanesReadTheRegistryOncePerEngineAndTTL: the data planes of every
// rank and every look-up within the TTL come from one registry read; the
// cache is read again after the TTL or once a call failed (Forget); a
// failed read is not cached, and a rank the registry does not hold is
// ErrNoWorker.
func TestPlanesReadTheRegistryOncePerEngineAndTTL(t *testing.T) {
	var finds atomic.Int32
	addr := "http://127.0.0.1:1"
	fail := false
	p := NewPlanes(func(_ context.Context, engineID string) ([]Worker, error) {
		finds.Add(1)
		if fail {
			return nil, ErrNoWorker
		}
		var ws []Worker
		for tp := range 8 {
			ws = append(ws, Worker{EngineID: engineID, Rank: kvcore.Rank{TP: tp}, Addr: addr + string(rune('0'+tp))})
		}
		return ws, nil
	}, func(addr string) *string { return &addr }, time.Second)
	now := time.Unix(1000, 0)
	p.now = func() time.Time { return now }
	ctx := context.Background()

	var wg sync.WaitGroup
	for range 4 { // four loads of eight ranks at once
		for tp := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := p.Rank(ctx, "prefill-0", kvcore.Rank{TP: tp}); err != nil {
					t.Error(err)
				}
			}()
		}
	}
	wg.Wait()
	if n := finds.Load(); n < 1 || n > 2 { // the first look-ups may race the cache once
		t.Fatalf("%d registry reads for 32 look-ups of one engine", n)
	}
	finds.Store(0)
	c0, _ := p.Rank(ctx, "prefill-0", kvcore.Rank{TP: 3})
	now = now.Add(999 * time.Millisecond)
	c1, _ := p.Rank(ctx, "prefill-0", kvcore.Rank{TP: 3})
	if finds.Load() != 0 || c0 != c1 {
		t.Fatalf("within the TTL: %d registry reads, same client %v", finds.Load(), c0 == c1)
	}
	if _, err := p.Rank(ctx, "prefill-0", kvcore.Rank{TP: 9}); !errors.Is(err, ErrNoWorker) {
		t.Fatalf("rank 9: %v, want ErrNoWorker", err)
	}
	now = now.Add(time.Millisecond)
	c2, _ := p.Rank(ctx, "prefill-0", kvcore.Rank{TP: 3})
	if finds.Load() != 1 || c2 != c0 {
		t.Fatalf("after the TTL: %d registry reads (want 1), the address's client kept %v", finds.Load(), c2 == c0)
	}
	p.Forget("prefill-0")
	fail = true
	for range 2 {
		if _, err := p.Rank(ctx, "prefill-0", kvcore.Rank{TP: 3}); !errors.Is(err, ErrNoWorker) {
			t.Fatalf("after forget with the engine gone: %v, want ErrNoWorker", err)
		}
	}
	if finds.Load() != 3 {
		t.Fatalf("%d registry reads, want 3: forget reads again, a failure is not cached", finds.Load())
	}
}
