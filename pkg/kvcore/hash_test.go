package kvcore

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"testing"
)

// promptTokens returns n deterministic token ids, different per seed.
func promptTokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	x := seed*2654435761 + 1
	for i := range out {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		out[i] = x % 150000
	}
	return out
}

// promptHashes is the hash chain of n tokens at m's hash block size.
func promptHashes(m *Model, n int, seed uint32) []BlockHash {
	return HashChain(promptTokens(n, seed), m.HashBlockSize, nil)
}

func TestHashTokensEncoding(t *testing.T) {
	parent := BlockHash{1, 2, 3}
	tokens := []uint32{7, 0x01020304}
	extra := []byte("lora-3")
	var want bytes.Buffer
	le := binary.LittleEndian
	want.Write(le.AppendUint32(nil, 3))
	want.Write(parent)
	want.Write(le.AppendUint32(nil, 2))
	want.Write(le.AppendUint32(nil, 7))
	want.Write(le.AppendUint32(nil, 0x01020304))
	want.Write(extra)
	sum := sha256.Sum256(want.Bytes())
	if got := HashTokens(parent, tokens, extra); !bytes.Equal(got, sum[:]) {
		t.Fatalf("HashTokens = %x, want the documented encoding %x", got, sum)
	}
}

func TestHashTokensUnambiguous(t *testing.T) {
	// Without length prefixes these two would hash the same bytes.
	a := HashTokens(nil, []uint32{5, 6}, nil)
	b := HashTokens(BlockHash(binary.LittleEndian.AppendUint32(nil, 5)), []uint32{6}, nil)
	if bytes.Equal(a, b) {
		t.Fatal("parent and tokens are not separated in the encoding")
	}
}

func TestHashChain(t *testing.T) {
	const bs = 16
	tokens := promptTokens(5*bs+7, 1)
	extra := []byte("salt")
	chain := HashChain(tokens, bs, extra)
	if len(chain) != 5 {
		t.Fatalf("%d hashes for 87 tokens at 16, want 5 (a partial block is not hashed)", len(chain))
	}
	if again := HashChain(tokens, bs, extra); !equalChains(chain, again) {
		t.Fatal("HashChain is not deterministic")
	}
	var parent BlockHash
	for i, h := range chain {
		if want := HashTokens(parent, tokens[i*bs:(i+1)*bs], extra); !bytes.Equal(h, want) {
			t.Fatalf("hash %d is not HashTokens(hash %d, block %d)", i, i-1, i)
		}
		parent = h
	}
	if prefix := HashChain(tokens[:3*bs], bs, extra); !equalChains(prefix, chain[:3]) {
		t.Fatal("the chain of a prefix is not a prefix of the chain")
	}
	changed := append([]uint32(nil), tokens...)
	changed[2*bs+3]++
	other := HashChain(changed, bs, extra)
	for i := range chain {
		if same := bytes.Equal(chain[i], other[i]); same != (i < 2) {
			t.Errorf("token change in block 2: hash %d unchanged = %v, want %v", i, same, i < 2)
		}
	}
	salted := HashChain(tokens, bs, []byte("other-salt"))
	for i := range chain {
		if bytes.Equal(chain[i], salted[i]) {
			t.Errorf("hash %d does not depend on the extras", i)
		}
	}
	for _, bad := range []int{0, -16} {
		if got := HashChain(tokens, bad, nil); got != nil {
			t.Errorf("HashChain(bs %d) = %d hashes, want nil", bad, len(got))
		}
	}
}

func equalChains(a, b []BlockHash) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

func TestParseBlockHash(t *testing.T) {
	h := HashTokens(nil, []uint32{1}, nil)
	got, err := ParseBlockHash(h.Hex())
	if err != nil || !bytes.Equal(got, h) {
		t.Fatalf("ParseBlockHash(Hex()) = %x, %v; want %x", got, err, h)
	}
	if h.Hex() != string(bytes.ToLower([]byte(h.Hex()))) || len(h.Hex()) != 64 {
		t.Fatalf("Hex() = %q, want 64 lower-case digits", h.Hex())
	}
	cases := []struct {
		in    string
		empty bool
	}{{"", true}, {"zz", false}, {"abc", false}, {"de ad", false}}
	for _, tc := range cases {
		_, err := ParseBlockHash(tc.in)
		if err == nil {
			t.Errorf("ParseBlockHash(%q) succeeded", tc.in)
		}
		if errors.Is(err, ErrEmptyHash) != tc.empty {
			t.Errorf("ParseBlockHash(%q) = %v, ErrEmptyHash want %v", tc.in, err, tc.empty)
		}
	}
}

// TestHashChainGolden pins one hash and its store key as kvmesh has always
// written them: keys already in a store pool must keep matching.
func TestHashChainGolden(t *testing.T) {
	toks := make([]uint32, 40)
	for i := range toks {
		toks[i] = uint32(i * 7919)
	}
	const want = "712f4e863ee5b5cd657310176fc34a6fff2f433bbc94f268f8f0479e17a088f5"
	chain := HashChain(toks, 16, []byte("lora-1"))
	if len(chain) != 2 || chain[1].Hex() != want {
		t.Fatalf("chain %x, want 2 hashes ending in %s", chain, want)
	}
	kb := KeyBuilder{Prefix: "dep", Model: "m"}
	if got := kb.Key(Rank{TP: 1}, 2, chain[1]); got != "dep@m@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2@"+want {
		t.Fatalf("key %q", got)
	}
	m := lookupModel(16, grpFull(16))
	p, err := PlanLookup(m, kb, chain, 32)
	if err != nil || len(p.Keys()) != 2 || p.Keys()[1] != kb.Key(Rank{}, 0, chain[1]) {
		t.Fatalf("plan keys %q (%v), want KeyBuilder's", p.Keys(), err)
	}
}
