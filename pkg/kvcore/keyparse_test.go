package kvcore

import (
	"errors"
	"strings"
	"testing"
)

func TestSplitKey(t *testing.T) {
	kb := KeyBuilder{Prefix: "dep", Model: "m"}
	r := Rank{TP: 3, PCP: 1, DCP: 0, PP: 2}
	key := kb.Key(r, 1, BlockHash{0xab, 0x01})
	tests := []struct {
		name, key, ns, hash string
		ok                  bool
	}{
		{"built key", key, kb.Namespace(r, 1), "ab01", true},
		{"no separator", "abc", "", "", false},
		{"empty hash", "ns@", "", "", false},
		{"empty namespace", "@ab", "", "", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ns, h, ok := SplitKey(tc.key)
			if ns != tc.ns || h != tc.hash || ok != tc.ok {
				t.Fatalf("SplitKey(%q) = %q, %q, %v; want %q, %q, %v", tc.key, ns, h, ok, tc.ns, tc.hash, tc.ok)
			}
		})
	}
}

func TestKeyBuilderParseOwn(t *testing.T) {
	kb := KeyBuilder{Prefix: "dep", Model: "m"}
	r := Rank{TP: 7, PP: 1}
	h := BlockHash{1, 2, 3, 4, 5, 6, 7, 8, 9}
	tests := []struct {
		name    string
		key     string
		ok      bool
		wantErr bool
	}{
		{"own key", kb.Key(r, 2, h), true, false},
		{"other model", KeyBuilder{Prefix: "dep", Model: "other"}.Key(r, 2, h), false, false},
		{"other fingerprint", KeyBuilder{Prefix: "dep", Model: "m", Fingerprint: "00112233445566ff"}.Key(r, 2, h), false, false},
		{"other prefix", KeyBuilder{Prefix: "x", Model: "m"}.Key(r, 2, h), false, false},
		{"no prefix", KeyBuilder{Model: "m"}.Key(r, 2, h), false, false},
		{"not a store key", "kvmesh-marker", false, true},
		{"upper-case hash", kb.Namespace(r, 2) + "@AB", false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, ok, err := kb.ParseOwn(tc.key)
			if ok != tc.ok || (err != nil) != tc.wantErr {
				t.Fatalf("ParseOwn(%q) = ok %v, err %v; want ok %v, err %v", tc.key, ok, err, tc.ok, tc.wantErr)
			}
			if tc.wantErr && !errors.Is(err, ErrBadKey) {
				t.Fatalf("error %v does not wrap ErrBadKey", err)
			}
			if ok && (p.Key() != tc.key || p.Rank != r || p.Group != 2 || p.Hash.Hex() != h.Hex()) {
				t.Fatalf("parts %+v do not give back %q", p, tc.key)
			}
		})
	}
}

// TestFingerprintSegment: a model's keys carry its fingerprint after the
// model name, in every combination of prefix and tenant, and take apart
// into the same parts; a malformed fingerprint is refused.
func TestFingerprintSegment(t *testing.T) {
	m := &Model{Name: "m", HashBlockSize: 16, Groups: []Group{{Kind: KindFullAttention, BlockSize: 16, BytesPerBlock: 64}}}
	fp := m.Fingerprint()
	r := Rank{TP: 1, PP: 2}
	h := BlockHash{0xca, 0xfe}
	builders := []struct {
		kb   KeyBuilder
		want string
	}{
		{KeysOf(m), "m@fp:" + fp + "@tp_rank:1@pcp0@dcp0@pp_rank:2@group:3@cafe"},
		{KeysOf(m).WithPrefix("dep"), "dep@m@fp:" + fp + "@tp_rank:1@pcp0@dcp0@pp_rank:2@group:3@cafe"},
		{KeysOf(m).ForTenant("acme"), "m@fp:" + fp + "@tenant:acme@tp_rank:1@pcp0@dcp0@pp_rank:2@group:3@cafe"},
		{KeysOf(m).WithPrefix("dep").ForTenant("acme"), "dep@m@fp:" + fp + "@tenant:acme@tp_rank:1@pcp0@dcp0@pp_rank:2@group:3@cafe"},
		{KeyBuilder{Prefix: "dep", Model: "m", Tenant: "acme"}, "dep@m@tenant:acme@tp_rank:1@pcp0@dcp0@pp_rank:2@group:3@cafe"},
	}
	for _, b := range builders {
		key := b.kb.Key(r, 3, h)
		if key != b.want {
			t.Errorf("Key = %q, want %q", key, b.want)
		}
		p, err := ParseKey(key)
		if err != nil {
			t.Fatalf("ParseKey(%q): %v", key, err)
		}
		if p.Prefix != b.kb.Prefix || p.Model != "m" || p.Fingerprint != b.kb.Fingerprint || p.Tenant != b.kb.Tenant || p.Key() != key {
			t.Errorf("ParseKey(%q) = %+v", key, p)
		}
	}
	for _, bad := range []string{
		"m@fp:" + fp[:15] + "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab",              // short
		"m@fp:" + strings.ToUpper(fp) + "x@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab", // not lower hex
		"dep@x@m@fp:" + fp + "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab",             // two fields before the model
		"m@tenant:acme@fp:" + fp + "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab",       // segments out of order
		"fp:" + fp + "@fp:" + fp + "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab",       // model named as the tag
	} {
		if _, err := ParseKey(bad); !errors.Is(err, ErrBadKey) {
			t.Errorf("ParseKey(%q) = %v, want ErrBadKey", bad, err)
		}
	}
	if err := (KeyBuilder{Model: "m", Fingerprint: "xyz"}).Validate(); !errors.Is(err, ErrBadKeyPrefix) {
		t.Errorf("Validate of a malformed fingerprint = %v, want ErrBadKeyPrefix", err)
	}
	if err := (KeyBuilder{Model: "fp:m"}).Validate(); !errors.Is(err, ErrBadKeyPrefix) {
		t.Errorf("Validate of a model named with the fingerprint tag = %v, want ErrBadKeyPrefix", err)
	}
}
