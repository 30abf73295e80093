package dataplane

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// FrameHeaderSize is the size of the fixed part of a FrameHeader on the
// wire; the identity's hash and request id follow it.
const FrameHeaderSize = 36

// frameMagic opens every wire frame.
const frameMagic = "KVB2"

// MaxFrameLen bounds one frame's data length (a block), 1 GiB.
const MaxFrameLen = 1 << 30

// frameNotHeld is the flag of a read-answer frame whose block was refused.
const frameNotHeld = 1

// FrameHeader precedes each block's bytes in a binary frame stream (the body
// of PathWrite requests and of PathRead answers). On the wire, big-endian:
//
//	offset size field
//	0      4    magic "KVB2"
//	4      4    group (uint32)
//	8      8    block id (int64)
//	16     4    data length in bytes (uint32)
//	20     4    CRC-32C of the data
//	24     8    write generation (read answers; 0 in writes)
//	32     1    flags: bit 0 = not held (read answers: the block was refused, no data follows)
//	33     1    hash length h (1..255 in writes)
//	34     2    request-id length q (0..1024)
//	36     h    the block's hash (lower-case hex text)
//	36+h   q    the request id
//
// The data follows the header; the next frame follows the data. A stream is
// a sequence of frames ending at the end of the body. In a write the
// identity is what the block will hold; in a read answer it is what the
// block holds (for a refused block: what it holds instead, empty when
// nothing).
type FrameHeader struct {
	// Group is the KV-group index.
	Group int
	// Block is the block id.
	Block kvcore.BlockID
	// Len is the number of data bytes after the header.
	Len int
	// Checksum is the CRC-32C of the data.
	Checksum uint32
	// Generation is the block's write generation (read answers).
	Generation uint64
	// NotHeld marks a refused block in a read answer (Len is 0).
	NotHeld bool
	// Identity is the block's identity.
	Identity Identity
}

// Ref returns the block the frame carries.
func (h FrameHeader) Ref() BlockRef { return BlockRef{Group: h.Group, Block: h.Block} }

// Size is the header's length on the wire, identity included.
func (h FrameHeader) Size() int {
	return FrameHeaderSize + len(h.Identity.Hash) + len(h.Identity.RequestID)
}

// AppendFrameHeader appends the wire form of h to dst. The identity's
// parts are cut at MaxHashLen and MaxRequestIDLen (Identity.Validate
// refuses longer ones first).
func AppendFrameHeader(dst []byte, h FrameHeader) []byte {
	hash, req := h.Identity.Hash, h.Identity.RequestID
	hash, req = hash[:min(len(hash), MaxHashLen)], req[:min(len(req), MaxRequestIDLen)]
	var flags byte
	if h.NotHeld {
		flags |= frameNotHeld
	}
	dst = append(dst, frameMagic...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Group))
	dst = binary.BigEndian.AppendUint64(dst, uint64(h.Block))
	dst = binary.BigEndian.AppendUint32(dst, uint32(h.Len))
	dst = binary.BigEndian.AppendUint32(dst, h.Checksum)
	dst = binary.BigEndian.AppendUint64(dst, h.Generation)
	dst = append(dst, flags, byte(len(hash)))
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(req)))
	dst = append(dst, hash...)
	return append(dst, req...)
}

// FrameHeaderLen is the length of the header AppendFrameHeader writes for
// a frame of identity id.
func FrameHeaderLen(id Identity) int {
	return FrameHeaderSize + min(len(id.Hash), MaxHashLen) + min(len(id.RequestID), MaxRequestIDLen)
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
		Group:      int(binary.BigEndian.Uint32(b[4:8])),
		Block:      kvcore.BlockID(binary.BigEndian.Uint64(b[8:16])),
		Len:        int(binary.BigEndian.Uint32(b[16:20])),
		Checksum:   binary.BigEndian.Uint32(b[20:24]),
		Generation: binary.BigEndian.Uint64(b[24:32]),
		NotHeld:    b[32]&frameNotHeld != 0,
	}
	if h.Len > MaxFrameLen {
		return FrameHeader{}, fmt.Errorf("frame of %d bytes over the %d limit: %w", h.Len, MaxFrameLen, ErrFrame)
	}
	hashLen, reqLen := int(b[33]), int(binary.BigEndian.Uint16(b[34:36]))
	if reqLen > MaxRequestIDLen {
		return FrameHeader{}, fmt.Errorf("request id of %d bytes over %d: %w", reqLen, MaxRequestIDLen, ErrFrame)
	}
	id := make([]byte, hashLen+reqLen)
	if _, err := io.ReadFull(r, id); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return FrameHeader{}, fmt.Errorf("truncated frame identity: %w", ErrFrame)
		}
		return FrameHeader{}, err
	}
	h.Identity = Identity{Hash: string(id[:hashLen]), RequestID: string(id[hashLen:])}
	return h, nil
}

// ReadFrameData reads a frame's data into dst (len(dst) must be h.Len) and
// verifies its checksum. A short body is an ErrFrame error, a mismatch an
// ErrChecksum error; either way dst may hold partial or wrong bytes.
func ReadFrameData(r io.Reader, h FrameHeader, dst []byte) error {
	if len(dst) != h.Len {
		return fmt.Errorf("frame of %d bytes into a %d-byte buffer: %w", h.Len, len(dst), ErrFrame)
	}
	d := newFrameData(r, h)
	if _, err := io.ReadFull(d, dst); err != nil {
		return err
	}
	return d.Verify()
}

// FrameData reads the data of one frame of a stream, checksumming what it
// reads: Read returns io.EOF at the frame's end, Verify then says whether
// the bytes match the frame header's checksum.
type FrameData struct {
	r    io.Reader
	h    FrameHeader
	left int
	crc  uint32
}

// newFrameData reads the data of the frame h from r.
func newFrameData(r io.Reader, h FrameHeader) *FrameData {
	return &FrameData{r: r, h: h, left: h.Len}
}

// Len is the frame's data length.
func (d *FrameData) Len() int { return d.h.Len }

// Read reads the frame's next bytes; a stream that ends inside the frame
// is an ErrFrame error.
func (d *FrameData) Read(p []byte) (int, error) {
	if d.left == 0 {
		return 0, io.EOF
	}
	n, err := d.r.Read(p[:min(len(p), d.left)])
	d.crc = crc32.Update(d.crc, castagnoli, p[:n])
	d.left -= n
	ended := errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
	switch {
	case ended && d.left > 0:
		return n, fmt.Errorf("group %d block %d: truncated data: %w", d.h.Group, d.h.Block, ErrFrame)
	case err != nil && !ended:
		return n, err
	}
	return n, nil
}

// Verify reports whether the frame was read whole and its bytes match the
// header's checksum (an ErrChecksum error when they do not).
func (d *FrameData) Verify() error {
	if d.left > 0 {
		return fmt.Errorf("group %d block %d: %d bytes not read: %w", d.h.Group, d.h.Block, d.left, ErrFrame)
	}
	if d.crc != d.h.Checksum {
		return fmt.Errorf("group %d block %d: crc32c %08x, header %08x: %w", d.h.Group, d.h.Block, d.crc, d.h.Checksum, ErrChecksum)
	}
	return nil
}

// finish reads and checks what the consumer left of the frame, so that the
// stream stands at the next frame.
func (d *FrameData) finish() error {
	if d.left == 0 {
		return nil
	}
	if _, err := io.Copy(io.Discard, d); err != nil {
		return err
	}
	return d.Verify()
}

// AppendFrameSegments appends the frame of one block to dst — h's header
// with Len and Checksum set from the data, then the bytes of segs in order
// — and returns the extended slice and the data length. The bytes are
// copied and checksummed in one pass (each piece checksummed while it is
// still in cache).
func AppendFrameSegments(dst []byte, h FrameHeader, segs [][]byte) ([]byte, int) {
	size := 0
	for _, s := range segs {
		size += len(s)
	}
	mark := len(dst)
	hl := FrameHeaderLen(h.Identity)
	dst = slices.Grow(dst, hl+size)[:mark+hl+size]
	data := dst[mark+hl:]
	var crc uint32
	for _, s := range segs {
		crc = copyCRC(data, s, crc)
		data = data[len(s):]
	}
	h.Len, h.Checksum = size, crc
	AppendFrameHeader(dst[mark:mark], h)
	return dst, size
}
