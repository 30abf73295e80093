package kvcore

import (
	"errors"
	"testing"
)

func TestCheckTokenIDs(t *testing.T) {
	cases := []struct {
		name           string
		hbs, n, hashes int
		ok             bool
	}{
		{"none", 16, 0, 0, true},
		{"none without a block size", 0, 0, 3, true},
		{"one block", 16, 16, 1, true},
		{"a prefix of the chain", 16, 32, 5, true},
		{"partial block", 16, 24, 5, false},
		{"past the chain", 16, 48, 2, false},
		{"no block size", 0, 16, 1, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := CheckTokenIDs(c.hbs, c.n, c.hashes)
			if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrBadTokenIDs)) {
				t.Fatalf("CheckTokenIDs(%d, %d, %d) = %v, want ok %v", c.hbs, c.n, c.hashes, err, c.ok)
			}
		})
	}
}

// seqTokens is n token ids 1, 2, …, n.
func seqTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i + 1)
	}
	return out
}
