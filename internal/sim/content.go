package sim

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// contentDomain separates the simulator's block contents from any other use
// of the same hashes.
const contentDomain = "kvmesh-sim/block-content/v2"

// BlockContent is the KV bytes the simulated engine "computes" for one
// block: a pure function of the model layout, the KV group, the rank
// namespace the block is stored under (kvcore.Model.StoreRank) and the
// block hash of the chunk's last hash-block. The bytes are a keyed
// counter stream (contentStream: SplitMix64's mix of a key taken from
// SHA-256 of those inputs plus a counter, 8 little-endian bytes a word),
// exactly the group's bytes_per_block long. It is not cryptographic; it
// only has to make every block's bytes its own, at memory speed, so that
// the engine's compute and every verification stay cheap next to the mesh
// they exercise, and be easy to reproduce in another language. Two engines computing the same prefix therefore produce the same
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
	s := c.stream(group, sr, hash)
	s.fill(out)
	return out
}

// nsFill computes the content nsBlock returns straight into dst, the
// block's regions in order (the stream continues across them).
func (c contents) nsFill(dst [][]byte, group int, sr kvcore.Rank, hash kvcore.BlockHash) {
	s := c.stream(group, sr, hash)
	for _, d := range dst {
		s.fill(d)
	}
}

// stream starts the content stream of one block.
func (c contents) stream(group int, sr kvcore.Rank, hash kvcore.BlockHash) contentStream {
	seed := c.seed(group, sr, hash)
	return contentStream{key: binary.LittleEndian.Uint64(seed[:8])}
}

// seed is SHA-256 of one block's content inputs; its first 8 bytes key the
// block's stream.
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
	s := c.stream(group, sr, hash)
	var want [4096]byte
	for len(got) > 0 {
		n := min(len(got), len(want))
		s.fill(want[:n])
		if !bytes.Equal(got[:n], want[:n]) {
			return false
		}
		got = got[n:]
	}
	return true
}

// contentStream is the bytes of one block's content from position pos
// on: word i (bytes [8i, 8i+8), little-endian) is streamWord(key, i).
type contentStream struct {
	key uint64
	pos uint64 // bytes produced so far
}

// fill writes the stream's next len(d) bytes into d.
func (s *contentStream) fill(d []byte) {
	for len(d) > 0 && s.pos%8 != 0 { // finish a word begun by the last fill
		d[0] = byte(streamWord(s.key, s.pos/8) >> (8 * (s.pos % 8)))
		d, s.pos = d[1:], s.pos+1
	}
	if len(d) == 0 {
		return
	}
	i := s.pos / 8
	z := s.key + i*splitMixGamma // the counter before word i's
	for ; len(d) >= 32; d = d[32:] {
		d := d[:32:32] // one bounds check for the four words
		g := splitMixGamma
		binary.LittleEndian.PutUint64(d[0:], splitMix(z+g))
		binary.LittleEndian.PutUint64(d[8:], splitMix(z+2*g))
		binary.LittleEndian.PutUint64(d[16:], splitMix(z+3*g))
		binary.LittleEndian.PutUint64(d[24:], splitMix(z+4*g))
		z, i = z+4*g, i+4
	}
	for ; len(d) >= 8; d = d[8:] {
		binary.LittleEndian.PutUint64(d, streamWord(s.key, i))
		i++
	}
	s.pos = 8 * i
	if len(d) > 0 {
		w := streamWord(s.key, i)
		for j := range d {
			d[j] = byte(w >> (8 * j))
		}
		s.pos += uint64(len(d))
	}
}

// splitMixGamma is SplitMix64's counter increment.
const splitMixGamma uint64 = 0x9e3779b97f4a7c15

// streamWord is SplitMix64's output for counter i of a stream keyed key.
func streamWord(key, i uint64) uint64 { return splitMix(key + (i+1)*splitMixGamma) }

// splitMix is SplitMix64's finaliser of counter value z.
func splitMix(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}
