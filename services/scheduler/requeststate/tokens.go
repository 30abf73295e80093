package requeststate

import "github.com/kvmesh/kvmesh/pkg/kvcore"

// taskTokens is the token list of a save task whose hash chain covers
// hashes hash blocks: the tracker's tokens of those blocks (a copy, so a
// task never aliases the tracker), nil when it holds none.
func (t *Tracker) taskTokens(m *kvcore.Model, hashes int) []uint32 {
	n := min(len(t.TokenIDs), hashes*m.HashBlockSize)
	if n <= 0 {
		return nil
	}
	return append([]uint32(nil), t.TokenIDs[:n]...)
}
