package sim

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// contentDomain separates the simulator's block contents from any other use
// of the same hashes.
const contentDomain = "kvmesh-sim/block-content/v1"

// BlockContent is the KV bytes the simulated engine "computes" for one
// block: a pure function of the model layout, the KV group, the rank
// namespace the block is stored under (kvcore.Model.StoreRank) and the
// block hash of the chunk's last hash-block. The bytes are a ChaCha8 stream
// keyed by SHA-256 of those inputs, exactly the group's bytes_per_block
// long. Two engines computing the same prefix therefore produce the same
// bytes, and a block loaded from the store or from another engine can be
// checked byte for byte against what its hash implies.
func BlockContent(m *kvcore.Model, group int, rank kvcore.Rank, hash kvcore.BlockHash) []byte {
	return newContents(m).block(group, rank, hash)
}

// contents computes BlockContent for one model, with its fingerprint
// computed once.
type contents struct {
	m  *kvcore.Model
	fp string
}

func newContents(m *kvcore.Model) contents { return contents{m: m, fp: m.Fingerprint()} }

// block returns the content of one block on worker rank rank.
func (c contents) block(group int, rank kvcore.Rank, hash kvcore.BlockHash) []byte {
	return c.nsBlock(group, c.m.StoreRank(group, rank), hash)
}

// nsBlock returns the content of one block in rank namespace sr (one of
// Model.Namespaces(group)): the bytes every worker rank whose StoreRank is
// sr holds.
func (c contents) nsBlock(group int, sr kvcore.Rank, hash kvcore.BlockHash) []byte {
	out := make([]byte, c.m.Groups[group].BytesPerBlock)
	_, _ = rand.NewChaCha8(c.seed(group, sr, hash)).Read(out) // ChaCha8.Read never fails
	return out
}

// nsFill computes the content nsBlock returns straight into dst, the
// block's regions in order (the stream continues across them).
func (c contents) nsFill(dst [][]byte, group int, sr kvcore.Rank, hash kvcore.BlockHash) {
	r := rand.NewChaCha8(c.seed(group, sr, hash))
	for _, d := range dst {
		_, _ = r.Read(d) // ChaCha8.Read never fails
	}
}

// seed is the ChaCha8 key of one block's content.
func (c contents) seed(group int, sr kvcore.Rank, hash kvcore.BlockHash) [32]byte {
	h := sha256.New()
	h.Write([]byte(contentDomain))
	h.Write([]byte(c.fp))
	var b [4 * 5]byte
	for i, v := range []int{group, sr.TP, sr.PCP, sr.DCP, sr.PP} {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
	}
	h.Write(b[:])
	h.Write(hash)
	var seed [32]byte
	copy(seed[:], h.Sum(nil))
	return seed
}

// matches reports whether got is exactly the content of the block in rank
// namespace sr.
func (c contents) matches(got []byte, group int, sr kvcore.Rank, hash kvcore.BlockHash) bool {
	if int64(len(got)) != c.m.Groups[group].BytesPerBlock {
		return false
	}
	return bytes.Equal(got, c.nsBlock(group, sr, hash))
}
