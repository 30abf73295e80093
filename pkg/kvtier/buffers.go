package kvtier

import (
	"sync"
	"time"
)

// buffers recycles the value buffers the tier fills itself: write-behind
// copies and the values GetEach reads from the bucket. Copying a 1 MiB
// block into a fresh slice costs its page faults and zeroing, several
// times the copy itself, and a stream of them keeps the garbage collector
// busy; a recycled buffer is already faulted in. A sync.Pool keeps as many
// as the traffic uses and lets the collector take them back when it stops.
type buffers struct{ p sync.Pool }

// get returns a buffer of length n (its contents undefined).
func (b *buffers) get(n int) []byte {
	if v, ok := b.p.Get().(*[]byte); ok && cap(*v) >= n {
		return (*v)[:n]
	}
	return make([]byte, n)
}

// put hands v back for reuse; the caller must not touch it again.
func (b *buffers) put(v []byte) {
	if cap(v) > 0 {
		b.p.Put(&v)
	}
}

// activity counts calls in progress and lets a background task wait for a
// moment when none is.
type activity struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n falls to 0; nil while n is 0
}

// begin counts one call in.
func (a *activity) begin() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n == 0 {
		a.idle = make(chan struct{})
	}
	a.n++
}

// end counts one call out.
func (a *activity) end() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n--; a.n == 0 {
		close(a.idle)
		a.idle = nil
	}
}

// wait returns once no call is in progress, or after at most d.
func (a *activity) wait(d time.Duration) {
	a.mu.Lock()
	idle := a.idle
	a.mu.Unlock()
	if idle == nil {
		return
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-idle:
	case <-timer.C:
	}
}
