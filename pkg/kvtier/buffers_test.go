package kvtier

import (
	"testing"
	"time"
)

func TestBuffersGet(t *testing.T) {
	var b buffers
	for _, n := range []int{1 << 20, 16, 1<<20 + 17, 0} {
		v := b.get(n)
		if len(v) != n {
			t.Fatalf("get(%d) has length %d", n, len(v))
		}
		b.put(v)
	}
}

func TestActivityWait(t *testing.T) {
	var a activity
	returned := func(d time.Duration) <-chan struct{} {
		done := make(chan struct{})
		go func() { a.wait(d); close(done) }()
		return done
	}
	select { // idle: at once, not after the hour
	case <-returned(time.Hour):
	case <-time.After(10 * time.Second):
		t.Fatal("wait with no call in progress did not return")
	}

	a.begin()
	a.begin()
	done := returned(time.Hour)
	a.end()
	select {
	case <-done:
		t.Fatal("wait returned while a call is still in progress")
	default:
	}
	a.end()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("wait did not return when the last call ended")
	}

	a.begin() // never ends: the bound ends the wait
	defer a.end()
	select {
	case <-returned(time.Millisecond):
	case <-time.After(10 * time.Second):
		t.Fatal("wait did not return after its bound")
	}
}
