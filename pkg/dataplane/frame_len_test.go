package dataplane

import (
	"strings"
	"testing"
)

// FrameHeaderLen is the length AppendFrameHeader writes, long identities
// (cut to their maxima) included: a read answer writes the header into the
// room FrameHeaderLen reserved.
func TestFrameHeaderLen(t *testing.T) {
	for _, id := range []Identity{
		{},
		{Hash: "ab", RequestID: "r"},
		{Hash: strings.Repeat("f", MaxHashLen+9), RequestID: strings.Repeat("q", MaxRequestIDLen+3)},
	} {
		if got, want := FrameHeaderLen(id), len(AppendFrameHeader(nil, FrameHeader{Identity: id, Len: 7})); got != want {
			t.Errorf("FrameHeaderLen(%d-byte hash, %d-byte request id) = %d, AppendFrameHeader wrote %d", len(id.Hash), len(id.RequestID), got, want)
		}
	}
}
