package sending

import (
	"strconv"
	"sync"
	"testing"
)

// TestRecentTasksForgetsTheOldest: the set holds the last n ids added, an
// id added again takes no second place, and the oldest is forgotten first.
func TestRecentTasksForgetsTheOldest(t *testing.T) {
	r := newRecentTasks(3)
	for _, id := range []string{"a", "b", "a", "c"} {
		r.add(id)
	}
	for _, id := range []string{"a", "b", "c"} {
		if !r.has(id) {
			t.Fatalf("%s forgotten with room for 3 ids", id)
		}
	}
	r.add("d") // forgets a, the oldest
	r.add("e") // forgets b
	for id, want := range map[string]bool{"a": false, "b": false, "c": true, "d": true, "e": true, "x": false} {
		if r.has(id) != want {
			t.Errorf("has(%s) = %v, want %v", id, !want, want)
		}
	}
	if len(r.ids) != 3 || len(r.ring) != 3 {
		t.Errorf("%d ids in the map, %d in the ring; want 3, 3", len(r.ids), len(r.ring))
	}
}

// TestRecentTasksConcurrentUse: lanes add and ask at once (run with -race);
// the set never grows past its size.
func TestRecentTasksConcurrentUse(t *testing.T) {
	const n = 64
	r := newRecentTasks(n)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 1000 {
				id := strconv.Itoa(g*1000 + i)
				r.add(id)
				_ = r.has(id)
			}
		})
	}
	wg.Wait()
	if len(r.ids) != n || len(r.ring) != n {
		t.Errorf("%d ids in the map, %d in the ring; want %d", len(r.ids), len(r.ring), n)
	}
}
