package dataplane

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// FrameHeaderSize is the size of a FrameHeader on the wire.
const FrameHeaderSize = 24

// frameMagic opens every wire frame.
const frameMagic = "KVB1"

// MaxFrameLen bounds one frame's data length (a block), 1 GiB.
const MaxFrameLen = 1 << 30

// FrameHeader precedes each block's bytes in a binary frame stream (the body
// of PathWrite requests and of PathRead answers). On the wire, big-endian:
//
//	offset size field
//	0      4    magic "KVB1"
//	4      4    group (uint32)
//	8      8    block id (int64)
//	16     4    data length in bytes (uint32)
//	20     4    CRC-32C of the data
//
// The data follows the header; the next frame follows the data. A stream is
// a sequence of frames ending at the end of the body.
type FrameHeader struct {
	// Group is the KV-group index.
	Group int
	// Block is the block id.
	Block kvcore.BlockID
	// Len is the number of data bytes after the header.
	Len int
	// Checksum is the CRC-32C of the data.
	Checksum uint32
}

// Ref returns the block the frame carries.
func (h FrameHeader) Ref() BlockRef { return BlockRef{Group: h.Group, Block: h.Block} }

// AppendFrameHeader appends the wire form of h to dst.
func AppendFrameHeader(dst []byte, h FrameHeader) []byte {
	dst = append(dst, frameMagic...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Group))
	dst = binary.BigEndian.AppendUint64(dst, uint64(h.Block))
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Len))
	return binary.BigEndian.AppendUint32(dst, h.Checksum)
}

// ReadFrameHeader reads the next frame header from r. At a clean end of the
// stream it returns io.EOF; a partial or malformed header is an ErrFrame
// error.
func ReadFrameHeader(r io.Reader) (FrameHeader, error) {
	var b [FrameHeaderSize]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return FrameHeader{}, io.EOF
		}
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return FrameHeader{}, fmt.Errorf("truncated frame header: %w", ErrFrame)
		}
		return FrameHeader{}, err
	}
	if string(b[:4]) != frameMagic {
		return FrameHeader{}, fmt.Errorf("bad frame magic %q: %w", b[:4], ErrFrame)
	}
	h := FrameHeader{
		Group:    int(binary.BigEndian.Uint32(b[4:8])),
		Block:    kvcore.BlockID(binary.BigEndian.Uint64(b[8:16])),
		Len:      int(binary.BigEndian.Uint32(b[16:20])),
		Checksum: binary.BigEndian.Uint32(b[20:24]),
	}
	if h.Len > MaxFrameLen {
		return FrameHeader{}, fmt.Errorf("frame of %d bytes over the %d limit: %w", h.Len, MaxFrameLen, ErrFrame)
	}
	return h, nil
}

// ReadFrameData reads a frame's data into dst (len(dst) must be h.Len) and
// verifies its checksum. A short body is an ErrFrame error, a mismatch an
// ErrChecksum error; either way dst may hold partial or wrong bytes.
func ReadFrameData(r io.Reader, h FrameHeader, dst []byte) error {
	if len(dst) != h.Len {
		return fmt.Errorf("frame of %d bytes into a %d-byte buffer: %w", h.Len, len(dst), ErrFrame)
	}
	if _, err := io.ReadFull(r, dst); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("group %d block %d: truncated data: %w", h.Group, h.Block, ErrFrame)
		}
		return err
	}
	if got := Checksum(dst); got != h.Checksum {
		return fmt.Errorf("group %d block %d: crc32c %08x, header %08x: %w", h.Group, h.Block, got, h.Checksum, ErrChecksum)
	}
	return nil
}
