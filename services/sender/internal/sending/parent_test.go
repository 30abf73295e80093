package sending

import "testing"

// TestParentIndex: a chunk's parent is the hash ending the block before
// its own, for whole blocks and for a sub-block tail alike.
func TestParentIndex(t *testing.T) {
	for _, tc := range []struct{ pos, step, want int }{
		{3, 4, -1}, // block 0 of 4 hash blocks: no parent
		{7, 4, 3},  // block 1: block 0's last hash
		{5, 4, 3},  // a tail ending inside block 1: also block 0's
		{4, 4, 3},  // a tail of one hash block into block 1
		{0, 1, -1}, // hash block = block: the first has none
		{2, 1, 1},
		{-1, 4, -1}, // not in the chain
	} {
		if got := parentIndex(tc.pos, tc.step); got != tc.want {
			t.Errorf("parentIndex(%d, %d) = %d, want %d", tc.pos, tc.step, got, tc.want)
		}
	}
}
