package kvcore

import (
	"errors"
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
