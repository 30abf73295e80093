package dataplane_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func fingerprint(t *testing.T) string {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	return m.Fingerprint()
}

func TestValueRoundTrip(t *testing.T) {
	fp := fingerprint(t)
	for _, payload := range [][]byte{{}, []byte("x"), bytes.Repeat([]byte{0xab, 0x01}, 40000)} {
		v := dataplane.EncodeValue(fp, payload)
		if len(v) != dataplane.ValueOverhead(len(fp))+len(payload) {
			t.Fatalf("encoded %d bytes, want overhead %d + %d", len(v), dataplane.ValueOverhead(len(fp)), len(payload))
		}
		got, err := dataplane.DecodeValue(fp, v)
		if err != nil {
			t.Fatalf("decode %d-byte payload: %v", len(payload), err)
		}
		if !bytes.Equal(got, payload) {
			t.Fatalf("payload of %d bytes came back as %d different bytes", len(payload), len(got))
		}
	}
}

func TestAppendValueMatchesEncode(t *testing.T) {
	fp := fingerprint(t)
	prefix := []byte("keep")
	got := dataplane.AppendValue(append([]byte(nil), prefix...), fp, []byte("payload"))
	want := append(append([]byte(nil), prefix...), dataplane.EncodeValue(fp, []byte("payload"))...)
	if !bytes.Equal(got, want) {
		t.Fatalf("AppendValue = %x, want %x", got, want)
	}
}

func TestDecodeValueRejects(t *testing.T) {
	fp := fingerprint(t)
	good := dataplane.EncodeValue(fp, []byte("the block bytes"))
	hdr := 6 + len(fp) // offset of the checksum
	mutate := func(f func(v []byte) []byte) []byte {
		return f(append([]byte(nil), good...))
	}
	tests := []struct {
		name  string
		fp    string
		value []byte
		want  error
	}{
		{"empty", fp, nil, dataplane.ErrFrame},
		{"shorter than the fixed header", fp, good[:10], dataplane.ErrFrame},
		{"bad magic", fp, mutate(func(v []byte) []byte { v[0] = 'X'; return v }), dataplane.ErrFrame},
		{"unknown version", fp, mutate(func(v []byte) []byte { v[4] = 9; return v }), dataplane.ErrFrame},
		{"fingerprint length past the end", fp, mutate(func(v []byte) []byte { v[5] = 255; return v }), dataplane.ErrFrame},
		{"payload truncated", fp, good[:len(good)-1], dataplane.ErrFrame},
		{"payload longer than the header says", fp, append(append([]byte(nil), good...), 0), dataplane.ErrFrame},
		{"length field altered", fp, mutate(func(v []byte) []byte {
			binary.BigEndian.PutUint64(v[hdr+4:], 3)
			return v
		}), dataplane.ErrFrame},
		{"other model's fingerprint", "0123456789abcdef", good, dataplane.ErrFingerprint},
		{"empty fingerprint asked", "", good, dataplane.ErrFingerprint},
		{"payload byte flipped", fp, mutate(func(v []byte) []byte { v[len(v)-1] ^= 0x01; return v }), dataplane.ErrChecksum},
		{"checksum altered", fp, mutate(func(v []byte) []byte { v[hdr] ^= 0x80; return v }), dataplane.ErrChecksum},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := dataplane.DecodeValue(tc.fp, tc.value)
			if !errors.Is(err, tc.want) {
				t.Fatalf("DecodeValue error = %v, want %v", err, tc.want)
			}
			if got != nil {
				t.Fatalf("DecodeValue returned %d payload bytes with an error", len(got))
			}
		})
	}
}

// splits cuts payload into segments at the given offsets.
func splits(payload []byte, at ...int) [][]byte {
	var segs [][]byte
	lo := 0
	for _, hi := range append(at, len(payload)) {
		segs = append(segs, payload[lo:hi])
		lo = hi
	}
	return segs
}

func TestValueSegments(t *testing.T) {
	fp := fingerprint(t)
	payload := make([]byte, 200000)
	for i := range payload {
		payload[i] = byte(i * 7 / 3)
	}
	tests := []struct {
		name string
		at   []int
	}{
		{"one segment", nil},
		{"two segments", []int{100000}},
		{"uneven segments, one empty", []int{1, 1, 40000, 199999}},
		{"segments across copy pieces", []int{32767, 65537, 131072}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prefix := []byte("keep")
			got := dataplane.AppendValueSegments(append([]byte(nil), prefix...), fp, splits(payload, tc.at...))
			want := append(append([]byte(nil), prefix...), dataplane.EncodeValue(fp, payload)...)
			if !bytes.Equal(got, want) {
				t.Fatalf("AppendValueSegments differs from EncodeValue of the whole payload")
			}
		})
	}
}

func TestFrameHeaderRoundTrip(t *testing.T) {
	data := []byte("block data")
	h := dataplane.FrameHeader{Group: 3, Block: 1 << 40, Len: len(data), Checksum: dataplane.Checksum(data)}
	wire := append(dataplane.AppendFrameHeader(nil, h), data...)
	if len(wire) != dataplane.FrameHeaderSize+len(data) {
		t.Fatalf("frame of %d bytes, want %d", len(wire), dataplane.FrameHeaderSize+len(data))
	}
	r := bytes.NewReader(wire)
	got, err := dataplane.ReadFrameHeader(r)
	if err != nil || got != h {
		t.Fatalf("ReadFrameHeader = %+v, %v; want %+v", got, err, h)
	}
	buf := make([]byte, got.Len)
	if err := dataplane.ReadFrameData(r, got, buf); err != nil || !bytes.Equal(buf, data) {
		t.Fatalf("ReadFrameData = %q, %v", buf, err)
	}
	if _, err := dataplane.ReadFrameHeader(r); err == nil || err.Error() != "EOF" {
		t.Fatalf("at the end ReadFrameHeader = %v, want io.EOF", err)
	}
}

func TestFrameRejects(t *testing.T) {
	data := []byte("block data")
	h := dataplane.FrameHeader{Group: 0, Block: 7, Len: len(data), Checksum: dataplane.Checksum(data)}
	good := append(dataplane.AppendFrameHeader(nil, h), data...)
	flip := func(i int) []byte {
		v := append([]byte(nil), good...)
		v[i] ^= 0xff
		return v
	}
	tests := []struct {
		name string
		wire []byte
		want error
	}{
		{"truncated header", good[:10], dataplane.ErrFrame},
		{"bad magic", flip(0), dataplane.ErrFrame},
		{"length over the limit", func() []byte {
			v := append([]byte(nil), good...)
			binary.BigEndian.PutUint32(v[16:], dataplane.MaxFrameLen+1)
			return v
		}(), dataplane.ErrFrame},
		{"truncated data", good[:len(good)-2], dataplane.ErrFrame},
		{"data byte flipped", flip(len(good) - 1), dataplane.ErrChecksum},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := bytes.NewReader(tc.wire)
			fh, err := dataplane.ReadFrameHeader(r)
			if err == nil {
				err = dataplane.ReadFrameData(r, fh, make([]byte, fh.Len))
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("error = %v, want %v", err, tc.want)
			}
		})
	}
}
