package kvcore

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash"
)

// BlockHash is the chained prefix hash of one hash-block of tokens. kvmesh's
// own hashes are 32 bytes (SHA-256); hashes supplied by an engine are opaque
// bytes of any non-zero length and are used as they are.
type BlockHash []byte

// Hex is the lower-case hex form used in store keys.
func (h BlockHash) Hex() string { return hex.EncodeToString(h) }

// ParseBlockHash decodes the hex form of a block hash.
func ParseBlockHash(s string) (BlockHash, error) {
	b, err := hex.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("block hash %q: %w", s, err)
	}
	if len(b) == 0 {
		return nil, fmt.Errorf("block hash: %w", ErrEmptyHash)
	}
	return BlockHash(b), nil
}

// HashTokens computes one link of the chain:
//
//	SHA-256( len(parent) as uint32 LE || parent ||
//	         len(tokens) as uint32 LE || each token as uint32 LE ||
//	         extra )
//
// parent is the previous block's hash (nil for the first block); extra carries
// anything else the KV depends on (LoRA id, multimodal hashes, cache salt).
// Length prefixes make the encoding unambiguous.
func HashTokens(parent BlockHash, tokens []uint32, extra []byte) BlockHash {
	var c chainHasher
	return c.link(nil, parent, tokens, extra)
}

// chainHasher hashes the links of one chain with one digest and one token
// buffer, so that a chain of thousands of blocks allocates neither per
// block.
type chainHasher struct {
	h   hash.Hash
	buf []byte
}

// link appends HashTokens(parent, tokens, extra) to dst and returns it.
func (c *chainHasher) link(dst []byte, parent BlockHash, tokens []uint32, extra []byte) []byte {
	if c.h == nil {
		c.h = sha256.New()
	}
	c.h.Reset()
	c.buf = binary.LittleEndian.AppendUint32(c.buf[:0], uint32(len(parent)))
	c.buf = append(c.buf, parent...)
	c.buf = binary.LittleEndian.AppendUint32(c.buf, uint32(len(tokens)))
	for _, t := range tokens {
		c.buf = binary.LittleEndian.AppendUint32(c.buf, t)
	}
	c.buf = append(c.buf, extra...)
	c.h.Write(c.buf)
	return c.h.Sum(dst)
}

// HashChain hashes every full hash-block of tokens: element i is the hash of
// tokens [0, (i+1)*hashBlockSize). A trailing partial block is not hashed.
// The hashes share one backing array.
func HashChain(tokens []uint32, hashBlockSize int, extra []byte) []BlockHash {
	if hashBlockSize <= 0 {
		return nil
	}
	n := len(tokens) / hashBlockSize
	out := make([]BlockHash, n)
	all := make([]byte, 0, n*sha256.Size)
	var c chainHasher
	var parent BlockHash
	for i := range out {
		all = c.link(all, parent, tokens[i*hashBlockSize:(i+1)*hashBlockSize], extra)
		parent = BlockHash(all[i*sha256.Size : (i+1)*sha256.Size : (i+1)*sha256.Size])
		out[i] = parent
	}
	return out
}
