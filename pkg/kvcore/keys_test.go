package kvcore

import (
	"bytes"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

func TestKeyLayout(t *testing.T) {
	h := BlockHash{0xde, 0xad, 0xbe, 0xef}
	cases := []struct {
		name  string
		kb    KeyBuilder
		rank  Rank
		group int
		want  string
	}{
		{"no prefix", KeyBuilder{Model: "m"}, Rank{}, 0, "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"},
		{"prefix", KeyBuilder{Prefix: "dep", Model: "m"}, Rank{}, 0, "dep@m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"},
		{"ranks", KeyBuilder{Model: "m"}, Rank{TP: 7, PCP: 1, DCP: 2, PP: 3}, 1, "m@tp_rank:7@pcp1@dcp2@pp_rank:3@group:1@deadbeef"},
		{"multi digit", KeyBuilder{Model: "m"}, Rank{TP: 15, PCP: 10, DCP: 100, PP: 12345}, 42, "m@tp_rank:15@pcp10@dcp100@pp_rank:12345@group:42@deadbeef"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.kb.Key(tc.rank, tc.group, h); got != tc.want {
				t.Fatalf("Key = %q, want %q", got, tc.want)
			}
			if got := tc.kb.KeyHex(tc.rank, tc.group, "deadbeef"); got != tc.want {
				t.Fatalf("KeyHex = %q, want %q", got, tc.want)
			}
			if got := tc.kb.Namespace(tc.rank, tc.group) + "@deadbeef"; got != tc.want {
				t.Fatalf("Namespace+hash = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestKeyRoundTrip(t *testing.T) {
	hashes := promptHashes(lookupModel(16, grpFull(16)), 64, 3)
	hashes = append(hashes, BlockHash{0}, BlockHash{0xff, 0x01})
	builders := []KeyBuilder{{Model: "test-model"}, {Prefix: "depA", Model: "dense-8b"}}
	ranks := []Rank{{}, {TP: 3, PCP: 1, DCP: 1, PP: 2}, {TP: 10, PP: 11}}
	for _, kb := range builders {
		for _, r := range ranks {
			for g, h := range hashes {
				key := kb.Key(r, g, h)
				p, err := ParseKey(key)
				if err != nil {
					t.Fatalf("ParseKey(%q): %v", key, err)
				}
				if p.Prefix != kb.Prefix || p.Model != kb.Model || p.Rank != r || p.Group != g || !bytes.Equal(p.Hash, h) {
					t.Fatalf("ParseKey(%q) = %+v", key, p)
				}
				if p.Key() != key {
					t.Fatalf("KeyParts.Key() = %q, want %q", p.Key(), key)
				}
			}
		}
	}
}

func TestParseKeyRejects(t *testing.T) {
	const ns = "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
	cases := map[string]string{
		"too few fields":      "m@tp_rank:0@pcp0@dcp0@pp_rank:0@deadbeef",
		"too many fields":     "a@b@" + ns + "@deadbeef",
		"empty prefix":        "@" + ns + "@deadbeef",
		"empty model":         "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef",
		"wrong tag":           "m@tp:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef",
		"fields out of order": "m@pcp0@tp_rank:0@dcp0@pp_rank:0@group:0@deadbeef",
		"negative rank":       "m@tp_rank:-1@pcp0@dcp0@pp_rank:0@group:0@deadbeef",
		"leading zero":        "m@tp_rank:01@pcp0@dcp0@pp_rank:0@group:0@deadbeef",
		"plus sign":           "m@tp_rank:0@pcp+1@dcp0@pp_rank:0@group:0@deadbeef",
		"missing number":      "m@tp_rank:0@pcp0@dcp@pp_rank:0@group:0@deadbeef",
		"not a number":        "m@tp_rank:0@pcp0@dcp0@pp_rank:x@group:0@deadbeef",
		"empty hash":          ns + "@",
		"odd hash":            ns + "@abc",
		"upper-case hash":     ns + "@DEADBEEF",
		"non-hex hash":        ns + "@xyz0",
		"empty":               "",
	}
	for name, key := range cases {
		t.Run(name, func(t *testing.T) {
			if p, err := ParseKey(key); !errors.Is(err, ErrBadKey) {
				t.Fatalf("ParseKey(%q) = %+v, %v; want ErrBadKey", key, p, err)
			}
		})
	}
}

func TestNewKeyBuilder(t *testing.T) {
	cases := []struct {
		prefix, model string
		ok            bool
	}{
		{"", "m", true},
		{"depA", "m", true},
		{"dep@A", "m", false},
		{"dep A", "m", false},
		{"depA", "", false},
		{"depA", "m@x", false},
		{"", "m\n", false},
	}
	for _, tc := range cases {
		kb, err := NewKeyBuilder(tc.prefix, &Model{Name: tc.model})
		if tc.ok != (err == nil) {
			t.Errorf("NewKeyBuilder(%q, %q) = %v, want ok %v", tc.prefix, tc.model, err, tc.ok)
		}
		if !tc.ok && !errors.Is(err, ErrBadKeyPrefix) {
			t.Errorf("NewKeyBuilder(%q, %q) = %v, want ErrBadKeyPrefix", tc.prefix, tc.model, err)
		}
		if tc.ok && (kb.Prefix != tc.prefix || kb.Model != tc.model || kb.Fingerprint != (&Model{Name: tc.model}).Fingerprint()) {
			t.Errorf("NewKeyBuilder(%q, %q) = %+v", tc.prefix, tc.model, kb)
		}
	}
}

func TestKeyAllocatesOnce(t *testing.T) {
	kb := KeyBuilder{Prefix: "depA", Model: "test-model"}
	h := HashTokens(nil, []uint32{1, 2, 3}, nil)
	r := Rank{TP: 3, PCP: 1, DCP: 2, PP: 12}
	if n := testing.AllocsPerRun(100, func() { _ = kb.Key(r, 2, h) }); n != 1 {
		t.Fatalf("Key allocates %v times, want 1 (the key itself)", n)
	}
}

// TestEncodeHexMatchesEncodingHex: the plan's hex encoder writes what
// encoding/hex does, for every byte value and for lengths around the
// stack buffer of writeHex.
func TestEncodeHexMatchesEncodingHex(t *testing.T) {
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	for _, n := range []int{0, 1, 2, 31, 32, 63, 64, 65, 129, 256} {
		src := all[len(all)-n:]
		dst := make([]byte, 2*n)
		encodeHex(dst, src)
		if want := hex.EncodeToString(src); string(dst) != want {
			t.Fatalf("encodeHex of %d bytes = %s, want %s", n, dst, want)
		}
		var sb strings.Builder
		writeHex(&sb, src)
		if want := hex.EncodeToString(src); sb.String() != want {
			t.Fatalf("writeHex of %d bytes = %s, want %s", n, sb.String(), want)
		}
	}
}
