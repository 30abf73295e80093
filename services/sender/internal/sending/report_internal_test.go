package sending

import (
	"reflect"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestEventTokens checks the token ids of one BlockStored event: each
// block's whole tokens, in order, or none when a block is not whole.
func TestEventTokens(t *testing.T) {
	tokens := make([]uint32, 128)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	cases := []struct {
		name     string
		hbs, bs  int
		run      []int
		from, to int // want tokens[from:to]; from == to: none
	}{
		{"one hash block a block", 16, 16, []int{0, 1, 2}, 0, 48},
		{"a run after its parent", 16, 16, []int{3, 4}, 48, 80},
		{"two hash blocks a block", 16, 32, []int{1, 3}, 0, 64},
		{"a key inside its block", 16, 32, []int{2}, 0, 0},
		{"a run ending inside a block", 16, 32, []int{1, 2}, 0, 0},
		{"past the tokens", 16, 16, []int{7, 8}, 0, 0},
		{"up to the last token", 16, 16, []int{6, 7}, 96, 128},
		{"not in the chain", 16, 16, []int{-1}, 0, 0},
		{"block not whole hash blocks", 16, 24, []int{2}, 0, 0},
		{"no run", 16, 16, nil, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := eventTokens(tokens, c.hbs, c.bs, c.run)
			if got == nil || !slices.Equal(got, tokens[c.from:c.to]) {
				t.Fatalf("eventTokens(%v) = %v, want tokens [%d,%d) (never nil)", c.run, got, c.from, c.to)
			}
		})
	}
	if got := eventTokens(nil, 16, 16, []int{0}); got == nil || len(got) != 0 {
		t.Fatalf("a task without tokens: %v, want []", got)
	}
}

// TestAnnouncedKeysHangFromPutOnes: a group's records announce the keys
// the save put and the present keys before the last put one in the chain
// of their namespace; a present key after it, or of a namespace where
// nothing was put, is left out.
func TestAnnouncedKeysHangFromPutOnes(t *testing.T) {
	chain := map[string]int{"h0": 0, "h1": 1, "h2": 2, "h3": 3}
	s := newSave(&kvcore.SaveTask{}, nil, kvcore.KeyBuilder{})
	s.stored[0] = []string{"ns@h0", "ns@h2"}
	s.present[0] = []string{"ns@h1", "ns@h3", "other@h1"}
	got := s.announced(0, chain)
	if want := map[string][]string{"ns": {"h0", "h2", "h1"}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("announced %v, want %v", got, want)
	}
	if got := s.announced(1, chain); len(got) != 0 {
		t.Fatalf("a group with nothing put announces %v", got)
	}
}
