package dataplane_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// hash64 is a 64-hex-digit chunk hash made of c.
func hash64(c string) string { return strings.Repeat(c, 64) }

func TestFrameHeaderIdentityRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		h    dataplane.FrameHeader
	}{
		{"write frame", dataplane.FrameHeader{Group: 1, Block: 7, Len: 4, Checksum: dataplane.Checksum([]byte("abcd")),
			Identity: dataplane.Identity{Hash: hash64("a"), RequestID: "req-1"}}},
		{"read answer with generation", dataplane.FrameHeader{Group: 3, Block: 1 << 40, Len: 1 << 20, Checksum: 0xdeadbeef,
			Generation: 1<<63 + 5, Identity: dataplane.Identity{Hash: "0f"}}},
		{"not-held frame holding another hash", dataplane.FrameHeader{Group: 0, Block: 2, NotHeld: true, Generation: 9,
			Identity: dataplane.Identity{Hash: hash64("b"), RequestID: "other"}}},
		{"not-held frame holding nothing", dataplane.FrameHeader{Group: 0, Block: 2, NotHeld: true}},
		{"longest identity", dataplane.FrameHeader{Group: 2, Block: 3, Len: 1,
			Identity: dataplane.Identity{Hash: strings.Repeat("c", dataplane.MaxHashLen), RequestID: strings.Repeat("r", dataplane.MaxRequestIDLen)}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			wire := dataplane.AppendFrameHeader([]byte("prefix"), tc.h)[len("prefix"):]
			if len(wire) != tc.h.Size() {
				t.Fatalf("wire header of %d bytes, Size() = %d", len(wire), tc.h.Size())
			}
			if string(wire[:4]) != "KVB2" {
				t.Fatalf("magic %q", wire[:4])
			}
			if got := binary.BigEndian.Uint64(wire[24:32]); got != tc.h.Generation {
				t.Fatalf("generation on the wire %d, want %d", got, tc.h.Generation)
			}
			if notHeld := wire[32]&1 != 0; notHeld != tc.h.NotHeld {
				t.Fatalf("not-held flag %v, want %v", notHeld, tc.h.NotHeld)
			}
			if int(wire[33]) != len(tc.h.Identity.Hash) || int(binary.BigEndian.Uint16(wire[34:36])) != len(tc.h.Identity.RequestID) {
				t.Fatalf("identity lengths %d/%d on the wire", wire[33], binary.BigEndian.Uint16(wire[34:36]))
			}
			if got := string(wire[dataplane.FrameHeaderSize : dataplane.FrameHeaderSize+len(tc.h.Identity.Hash)]); got != tc.h.Identity.Hash {
				t.Fatalf("hash on the wire %q", got)
			}
			r := bytes.NewReader(append(wire, "next"...))
			got, err := dataplane.ReadFrameHeader(r)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.h {
				t.Fatalf("read back %+v, want %+v", got, tc.h)
			}
			if rest, _ := io.ReadAll(r); string(rest) != "next" {
				t.Fatalf("the header read consumed %q of what follows", rest)
			}
		})
	}
}

func TestFrameRoundTripWithData(t *testing.T) {
	blocks := []dataplane.Block{
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}, Identity: dataplane.Identity{Hash: hash64("1"), RequestID: "r1"}, Data: []byte("first block")},
		{BlockRef: dataplane.BlockRef{Group: 1, Block: 2}, Identity: dataplane.Identity{Hash: hash64("2")}, Data: bytes.Repeat([]byte{7}, 4096)},
	}
	var stream []byte
	for _, b := range blocks {
		stream = dataplane.AppendFrameHeader(stream, dataplane.FrameHeader{
			Group: b.Group, Block: b.Block, Len: len(b.Data), Checksum: dataplane.Checksum(b.Data), Identity: b.Identity,
		})
		stream = append(stream, b.Data...)
	}
	r := bytes.NewReader(stream)
	for i, want := range blocks {
		h, err := dataplane.ReadFrameHeader(r)
		if err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if h.Ref() != want.BlockRef || h.Identity != want.Identity {
			t.Fatalf("frame %d is %+v", i, h)
		}
		data := make([]byte, h.Len)
		if err := dataplane.ReadFrameData(r, h, data); err != nil || !bytes.Equal(data, want.Data) {
			t.Fatalf("frame %d data: %v", i, err)
		}
	}
	if _, err := dataplane.ReadFrameHeader(r); !errors.Is(err, io.EOF) {
		t.Fatalf("after the last frame: %v, want io.EOF", err)
	}
}

func TestReadFrameHeaderRejects(t *testing.T) {
	good := dataplane.AppendFrameHeader(nil, dataplane.FrameHeader{
		Group: 1, Block: 2, Len: 4, Identity: dataplane.Identity{Hash: hash64("d"), RequestID: "req"},
	})
	with := func(edit func(b []byte) []byte) []byte { return edit(append([]byte(nil), good...)) }
	tests := []struct {
		name string
		wire []byte
	}{
		{"truncated fixed header", good[:dataplane.FrameHeaderSize-1]},
		{"truncated hash", good[:dataplane.FrameHeaderSize+10]},
		{"truncated request id", good[:len(good)-1]},
		{"version 1 magic", with(func(b []byte) []byte { copy(b, "KVB1"); return b })},
		{"data length over the limit", with(func(b []byte) []byte {
			binary.BigEndian.PutUint32(b[16:20], dataplane.MaxFrameLen+1)
			return b
		})},
		{"request id length over the limit", with(func(b []byte) []byte {
			binary.BigEndian.PutUint16(b[34:36], dataplane.MaxRequestIDLen+1)
			return append(b, make([]byte, dataplane.MaxRequestIDLen+1)...)
		})},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if h, err := dataplane.ReadFrameHeader(bytes.NewReader(tc.wire)); !errors.Is(err, dataplane.ErrFrame) {
				t.Fatalf("ReadFrameHeader = %+v, %v; want ErrFrame", h, err)
			}
		})
	}
}

func TestIdentityValidate(t *testing.T) {
	tests := []struct {
		name string
		id   dataplane.Identity
		ok   bool
	}{
		{"chain hash and request", dataplane.Identity{Hash: hash64("e"), RequestID: "req-1"}, true},
		{"hash without request", dataplane.Identity{Hash: "ab"}, true},
		{"longest parts", dataplane.Identity{Hash: strings.Repeat("a", dataplane.MaxHashLen), RequestID: strings.Repeat("r", dataplane.MaxRequestIDLen)}, true},
		{"no hash", dataplane.Identity{RequestID: "req-1"}, false},
		{"hash too long", dataplane.Identity{Hash: strings.Repeat("a", dataplane.MaxHashLen+1)}, false},
		{"request id too long", dataplane.Identity{Hash: "ab", RequestID: strings.Repeat("r", dataplane.MaxRequestIDLen+1)}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.id.Validate()
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, dataplane.ErrIdentity)) {
				t.Fatalf("Validate = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestNotHeldReasonNamesBothHashes(t *testing.T) {
	want := hash64("f")
	if got := dataplane.NotHeldReason(want, dataplane.Identity{}, 0); !strings.Contains(got, "holds nothing") || !strings.Contains(got, want) {
		t.Fatalf("empty block reason %q", got)
	}
	held := dataplane.Identity{Hash: hash64("0"), RequestID: "req-other"}
	got := dataplane.NotHeldReason(want, held, 42)
	for _, part := range []string{want, held.Hash, held.RequestID, "42"} {
		if !strings.Contains(got, part) {
			t.Fatalf("reason %q lacks %q", got, part)
		}
	}
}

func TestAppendFrameSegmentsMatchesHeaderAndData(t *testing.T) {
	segs := [][]byte{bytes.Repeat([]byte("x"), 40<<10), []byte("yz"), bytes.Repeat([]byte{7}, 70<<10)}
	data := bytes.Join(segs, nil)
	h := dataplane.FrameHeader{Group: 1, Block: 9, Generation: 3, Identity: dataplane.Identity{Hash: hash64("d"), RequestID: "r"}}
	got, n := dataplane.AppendFrameSegments([]byte("prefix"), h, segs)
	if n != len(data) {
		t.Fatalf("data length %d, want %d", n, len(data))
	}
	want := h
	want.Len, want.Checksum = len(data), dataplane.Checksum(data)
	wire := append(dataplane.AppendFrameHeader([]byte("prefix"), want), data...)
	if !bytes.Equal(got, wire) {
		t.Fatal("AppendFrameSegments differs from AppendFrameHeader + data")
	}
	r := bytes.NewReader(got[len("prefix"):])
	fh, err := dataplane.ReadFrameHeader(r)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, fh.Len)
	if err := dataplane.ReadFrameData(r, fh, buf); err != nil || !bytes.Equal(buf, data) {
		t.Fatalf("read back: %v", err)
	}
}
