package sim

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
)

// errReplicaDown marks a call that a replica failed to answer (a
// connection error or a time-out) or answered with a 5xx: the same call
// may succeed on another replica of the service.
var errReplicaDown = errors.New("replica unavailable")

// replicas are the base URLs of one service's replicas, which share their
// state (PostgreSQL, the consumer groups), so any of them can answer any
// call. A call goes first to the replica that answered last; when that one
// is unavailable it moves on to the next, each replica at most once per
// call, so a dead replica costs one refused connection. Once every replica
// failed the caller's own retry and backoff take over.
type replicas struct {
	urls []string
	cur  atomic.Int64 // index of the replica tried first
}

func newReplicas(urls []string) *replicas { return &replicas{urls: urls} }

// replicaURLs is a service's replica list: single split at commas (it may
// hold one URL or several), then list, with blanks and repeats left out.
func replicaURLs(single string, list []string) []string {
	var out []string
	for _, u := range append(strings.Split(single, ","), list...) {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" && !slices.Contains(out, u) {
			out = append(out, u)
		}
	}
	return out
}

// do calls fn with a replica's base URL until it returns nil or an error
// down does not count as the replica being unavailable, trying each
// replica once, starting at the one that answered last; it returns fn's
// last error. It stops early when ctx ends.
func (r *replicas) do(ctx context.Context, down func(error) bool, fn func(base string) error) error {
	n := int64(len(r.urls))
	if n == 0 {
		return errReplicaDown
	}
	start := r.cur.Load()
	var err error
	for i := range n {
		k := (start + i) % n
		if err = fn(r.urls[k]); err == nil || !down(err) {
			r.cur.Store(k) // it answered
			return err
		}
		r.cur.CompareAndSwap(k, (k+1)%n) // concurrent callers skip it too
		if ctx.Err() != nil {
			return err
		}
	}
	return err
}

// replicaDown reports an error of getJSON that another replica may not
// give.
func replicaDown(err error) bool { return errors.Is(err, errReplicaDown) }
