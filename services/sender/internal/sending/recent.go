package sending

import "sync"

// DefaultRecentTasks is how many task ids a Processor remembers as
// committed (recentTasks).
const DefaultRecentTasks = 4096

// recentTasks is a bounded set of the task ids this process committed, or
// found already done when it committed: the last n of them, in a fixed
// ring of ids with a map for membership, the oldest forgotten when an id
// beyond n is added. Handle skips a task in it as a duplicate with no
// store call, put or commit (a record delivered again to the process that
// handled it: a redelivery after a rebalance back, a record the outbox
// relay published twice). A task not in it goes ahead, and the commit's
// own dedupe (ledger.Entry.DropIfDone: the outcome inserted only if new,
// the messages only with it, the dead letters rolled back) is the proof
// that nothing is published twice; the set only saves the work.
//
// It stands in for a SELECT on save_outcomes per task, one PostgreSQL
// round trip and transaction that only a redelivered task needed. It is a
// tiny type of its own rather than an LRU library: membership and
// first-in-first-out forgetting are all it needs (a redelivery comes soon
// after the first delivery, or from another process whose set never held
// it). It is safe for concurrent use.
type recentTasks struct {
	mu   sync.Mutex
	ids  map[string]struct{}
	ring []string // the ids in order of addition; next is the oldest once full
	next int
}

// newRecentTasks returns an empty set that remembers n ids (n > 0).
func newRecentTasks(n int) *recentTasks {
	return &recentTasks{ids: make(map[string]struct{}, n), ring: make([]string, 0, n)}
}

// has reports whether id is in the set.
func (r *recentTasks) has(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.ids[id]
	return ok
}

// add puts id in the set, forgetting the oldest id when the set is full.
func (r *recentTasks) add(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.ids[id]; ok {
		return
	}
	if len(r.ring) < cap(r.ring) {
		r.ring = append(r.ring, id)
	} else {
		delete(r.ids, r.ring[r.next])
		r.ring[r.next] = id
		r.next = (r.next + 1) % len(r.ring)
	}
	r.ids[id] = struct{}{}
}
