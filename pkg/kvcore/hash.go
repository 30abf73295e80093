package kvcore

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
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
	h := sha256.New()
	var n [4]byte
	binary.LittleEndian.PutUint32(n[:], uint32(len(parent)))
	h.Write(n[:])
	h.Write(parent)
	binary.LittleEndian.PutUint32(n[:], uint32(len(tokens)))
	h.Write(n[:])
	buf := make([]byte, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(buf[4*i:], t)
	}
	h.Write(buf)
	h.Write(extra)
	return BlockHash(h.Sum(nil))
}

// HashChain hashes every full hash-block of tokens: element i is the hash of
// tokens [0, (i+1)*hashBlockSize). A trailing partial block is not hashed.
func HashChain(tokens []uint32, hashBlockSize int, extra []byte) []BlockHash {
	if hashBlockSize <= 0 {
		return nil
	}
	n := len(tokens) / hashBlockSize
	out := make([]BlockHash, 0, n)
	var parent BlockHash
	for i := 0; i < n; i++ {
		parent = HashTokens(parent, tokens[i*hashBlockSize:(i+1)*hashBlockSize], extra)
		out = append(out, parent)
	}
	return out
}
