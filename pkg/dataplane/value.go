package dataplane

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"slices"
)

// Value framing in the store:
//
//	offset size field
//	0      4    magic "KVV1"
//	4      1    version (1)
//	5      1    fingerprint length n (≤ 255)
//	6      n    model fingerprint (kvcore.Model.Fingerprint), ASCII
//	6+n    4    CRC-32C (Castagnoli) of the payload, big-endian
//	10+n   8    payload length, big-endian
//	18+n   …    payload (the block bytes)
const (
	valueMagic   = "KVV1"
	valueVersion = 1
	valueFixed   = 4 + 1 + 1 + 4 + 8
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the CRC-32C of b, the checksum used by value and wire frames.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// ValueOverhead is the number of bytes EncodeValue adds to a payload for a
// fingerprint of length fpLen.
func ValueOverhead(fpLen int) int { return valueFixed + fpLen }

// EncodeValue frames payload for the store: magic, version, the model
// fingerprint, the payload's checksum and the payload. A fingerprint longer
// than 255 bytes is truncated to 255 bytes (kvmesh's are 16).
func EncodeValue(fingerprint string, payload []byte) []byte {
	return AppendValue(make([]byte, 0, ValueOverhead(min(len(fingerprint), 255))+len(payload)), fingerprint, payload)
}

// AppendValue appends the framed value of payload to dst and returns the
// extended slice, so callers can reuse buffers.
func AppendValue(dst []byte, fingerprint string, payload []byte) []byte {
	if len(fingerprint) > 255 {
		fingerprint = fingerprint[:255]
	}
	dst = append(dst, valueMagic...)
	dst = append(dst, valueVersion, byte(len(fingerprint)))
	dst = append(dst, fingerprint...)
	dst = binary.BigEndian.AppendUint32(dst, Checksum(payload))
	dst = binary.BigEndian.AppendUint64(dst, uint64(len(payload)))
	return append(dst, payload...)
}

// DecodeValue checks a framed value and returns its payload, a sub-slice of
// value (no copy). It rejects a malformed frame (ErrFrame), a value written
// under another fingerprint (ErrFingerprint) and a payload whose checksum
// does not match (ErrChecksum), in that order.
func DecodeValue(fingerprint string, value []byte) ([]byte, error) {
	payload, sum, err := parseValue(fingerprint, value)
	if err != nil {
		return nil, err
	}
	if got := Checksum(payload); got != sum {
		return nil, fmt.Errorf("payload crc32c %08x, header %08x: %w", got, sum, ErrChecksum)
	}
	return payload, nil
}

// parseValue checks a framed value's header and fingerprint and returns its
// payload (a sub-slice of value) and the checksum its header records.
func parseValue(fingerprint string, value []byte) ([]byte, uint32, error) {
	if len(value) < valueFixed {
		return nil, 0, fmt.Errorf("value of %d bytes is shorter than a header: %w", len(value), ErrFrame)
	}
	if string(value[:4]) != valueMagic {
		return nil, 0, fmt.Errorf("bad magic %q: %w", value[:4], ErrFrame)
	}
	if value[4] != valueVersion {
		return nil, 0, fmt.Errorf("unknown version %d: %w", value[4], ErrFrame)
	}
	n := int(value[5])
	if len(value) < valueFixed+n {
		return nil, 0, fmt.Errorf("value of %d bytes is shorter than its header: %w", len(value), ErrFrame)
	}
	fp, rest := value[6:6+n], value[6+n:]
	sum := binary.BigEndian.Uint32(rest[:4])
	size := binary.BigEndian.Uint64(rest[4:12])
	payload := rest[12:]
	if uint64(len(payload)) != size {
		return nil, 0, fmt.Errorf("payload of %d bytes, header says %d: %w", len(payload), size, ErrFrame)
	}
	if string(fp) != fingerprint {
		return nil, 0, fmt.Errorf("value fingerprint %q, model %q: %w", fp, fingerprint, ErrFingerprint)
	}
	return payload, sum, nil
}

// copyPiece is how many bytes the fused copy-and-checksum loops copy before
// checksumming them: small enough that the checksum reads the piece just
// written from the CPU cache, large enough to keep the per-call cost
// negligible. Fusing the two passes reads each byte from memory once.
const copyPiece = 32 << 10

// copyCRC copies src to dst (len(dst) ≥ len(src)) piece by piece, updating
// the CRC-32C crc with each piece while it is still in cache, and returns
// the updated checksum.
func copyCRC(dst, src []byte, crc uint32) uint32 {
	for len(src) > 0 {
		n := copy(dst[:min(len(src), copyPiece)], src)
		crc = crc32.Update(crc, castagnoli, dst[:n])
		dst, src = dst[n:], src[n:]
	}
	return crc
}

// AppendValueSegments appends the framed value of the payload made of segs
// in order (a block stored as several regions, or one) to dst and returns
// the extended slice. The payload is copied and checksummed in one pass
// (the one copy between the pool and the socket); the stored bytes are the
// same as AppendValue's of the concatenated payload.
func AppendValueSegments(dst []byte, fingerprint string, segs [][]byte) []byte {
	if len(fingerprint) > 255 {
		fingerprint = fingerprint[:255]
	}
	size := 0
	for _, s := range segs {
		size += len(s)
	}
	dst = append(dst, valueMagic...)
	dst = append(dst, valueVersion, byte(len(fingerprint)))
	dst = append(dst, fingerprint...)
	at := len(dst)
	dst = binary.BigEndian.AppendUint32(dst, 0) // the checksum, once known
	dst = binary.BigEndian.AppendUint64(dst, uint64(size))
	dst = slices.Grow(dst, size)
	out := dst[len(dst) : len(dst)+size]
	var crc uint32
	for _, s := range segs {
		crc = copyCRC(out, s, crc)
		out = out[len(s):]
	}
	binary.BigEndian.PutUint32(dst[at:], crc)
	return dst[:len(dst)+size]
}
