package connector_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
)

// scripted is a child with a fixed answer that counts its calls.
type scripted struct {
	name  string
	ans   connector.Answer
	err   error
	calls int
}

// scriptedChain is a chain of scripted children a, b, … answering answers
// in order.
func scriptedChain(t *testing.T, answers []connector.Answer) (*connector.Chain, []*scripted) {
	t.Helper()
	var children []connector.Connector
	var fakes []*scripted
	for i, a := range answers {
		f := &scripted{name: string(rune('a' + i)), ans: a}
		fakes, children = append(fakes, f), append(children, f)
	}
	chain, err := connector.NewChain(children...)
	if err != nil {
		t.Fatal(err)
	}
	return chain, fakes
}

func (s *scripted) Name() string { return s.name }

func (s *scripted) Lookup(context.Context, *connector.Query) (connector.Answer, error) {
	s.calls++
	return s.ans, s.err
}

func TestChainAsksEveryChildAndSelects(t *testing.T) {
	cases := []struct {
		name        string
		answers     []connector.Answer
		wantChosen  int
		wantTokens  int
		wantPending bool
	}{
		{"first positive wins", []connector.Answer{{Tokens: 0}, {Tokens: 32}, {Tokens: 48}}, 1, 32, false},
		{"earlier positive wins over a larger later one", []connector.Answer{{Tokens: 16}, {Tokens: 48}}, 0, 16, false},
		{"none positive", []connector.Answer{{}, {}}, kvcore.NoChild, 0, false},
		{"a pending child makes it not yet", []connector.Answer{{Tokens: 32}, {Pending: true}}, kvcore.NoChild, 0, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			chain, fakes := scriptedChain(t, tc.answers)
			res, err := chain.Lookup(context.Background(), &connector.Query{})
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range fakes {
				if f.calls != 1 {
					t.Errorf("child %s asked %d times, want 1 (no short-circuit)", f.name, f.calls)
				}
			}
			sel := res.Selection
			if sel.Chosen != tc.wantChosen || sel.Tokens != tc.wantTokens || sel.Pending != tc.wantPending {
				t.Errorf("selection %+v, want chosen %d tokens %d pending %v", sel, tc.wantChosen, tc.wantTokens, tc.wantPending)
			}
			if _, ok := res.Chosen(); ok != (tc.wantChosen >= 0) {
				t.Errorf("Chosen() ok = %v", ok)
			}
		})
	}
}

func TestChainChildErrorFailsTheLookup(t *testing.T) {
	boom := errors.New("boom")
	first := &scripted{name: "a", ans: connector.Answer{Tokens: 16}}
	broken := &scripted{name: "b", err: boom}
	chain, err := connector.NewChain(first, broken)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := chain.Lookup(context.Background(), &connector.Query{}); !errors.Is(err, boom) {
		t.Fatalf("Lookup = %v, want the child's error", err)
	}
}

// TestChainFailedChildFailsOpen: a child whose check failed answers 0 and
// the chain goes on, as vLLM's MultiConnector does with a store child that
// answered 0 after a failed lookup: a later child's hit wins, and with no
// hit the answer is 0, never an error.
func TestChainFailedChildFailsOpen(t *testing.T) {
	outage := fmt.Errorf("%w: %w", connector.ErrStore, kvstore.ErrUnavailable)
	cases := []struct {
		name       string
		answers    []connector.Answer
		wantChosen int
		wantTokens int
		wantFailed []int
	}{
		{"store only", []connector.Answer{{Failed: outage}}, kvcore.NoChild, 0, []int{0}},
		{"pd after a failed store wins", []connector.Answer{{Failed: outage}, {Tokens: 32}}, 1, 32, []int{0}},
		{"pd before a failed store wins", []connector.Answer{{Tokens: 32}, {Failed: outage}}, 0, 32, []int{1}},
		{"no failure", []connector.Answer{{}, {Tokens: 16}}, 1, 16, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			chain, fakes := scriptedChain(t, tc.answers)
			res, err := chain.Lookup(context.Background(), &connector.Query{})
			if err != nil {
				t.Fatalf("Lookup = %v, want no error (fail open)", err)
			}
			for _, f := range fakes {
				if f.calls != 1 {
					t.Errorf("child %s asked %d times, want 1", f.name, f.calls)
				}
			}
			if sel := res.Selection; sel.Chosen != tc.wantChosen || sel.Tokens != tc.wantTokens || sel.Pending {
				t.Errorf("selection %+v, want chosen %d tokens %d", sel, tc.wantChosen, tc.wantTokens)
			}
			if got := res.Failures(); !reflect.DeepEqual(got, tc.wantFailed) {
				t.Errorf("Failures() = %v, want %v", got, tc.wantFailed)
			}
			for _, i := range tc.wantFailed {
				if r := res.Answers[i].FailureReason(); r != kvstore.StatusUnavailable {
					t.Errorf("answer %d FailureReason %q, want unavailable", i, r)
				}
			}
			if want := []string{"a", "b"}[:len(tc.answers)]; !reflect.DeepEqual(chain.Names(), want) {
				t.Errorf("Names() = %v, want %v", chain.Names(), want)
			}
		})
	}
}

func TestCheckNames(t *testing.T) {
	cases := []struct {
		names []string
		want  error
	}{
		{[]string{"store"}, nil},
		{[]string{"pd", "store"}, nil},
		{nil, connector.ErrEmptyChain},
		{[]string{"store", "lmcache"}, connector.ErrUnknownConnector},
		{[]string{"store", "store"}, connector.ErrDuplicateConnector},
	}
	for _, tc := range cases {
		if err := connector.CheckNames(tc.names); !errors.Is(err, tc.want) {
			t.Errorf("CheckNames(%q) = %v, want %v", tc.names, err, tc.want)
		}
	}
	if _, err := connector.NewChain(&scripted{name: "x"}, &scripted{name: "x"}); !errors.Is(err, connector.ErrDuplicateConnector) {
		t.Errorf("NewChain(x, x) = %v, want ErrDuplicateConnector", err)
	}
}

func TestPDHit(t *testing.T) {
	cases := []struct {
		remote, tokens, sbs, want int
	}{
		{48, 48, 16, 32},  // whole prompt minus the last token, aligned down
		{48, 49, 16, 48},  // the last token lies past the prefill
		{100, 49, 16, 48}, // never more than num_tokens - 1
		{20, 64, 16, 16},  // partial remote block is not loaded
		{15, 64, 16, 0},
		{0, 64, 16, 0},
		{48, 0, 16, 0},
		{64, 65, 32, 64},
	}
	for _, tc := range cases {
		if got := connector.PDHit(tc.remote, tc.tokens, tc.sbs); got != tc.want {
			t.Errorf("PDHit(remote %d, tokens %d, sbs %d) = %d, want %d", tc.remote, tc.tokens, tc.sbs, got, tc.want)
		}
	}
}

func denseModel() *kvcore.Model {
	return &kvcore.Model{Name: "test-model", HashBlockSize: 16,
		Groups: []kvcore.Group{{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 1024}}}
}

func TestPDChild(t *testing.T) {
	src := &contract.PDSource{EngineID: "prefill-0", BlockTable: kvcore.BlockTable{{4, 5, 6}}, Tokens: 48}
	pd := connector.NewPD(denseModel())
	cases := []struct {
		name string
		q    connector.Query
		want connector.Answer
	}{
		{"no params", connector.Query{NumTokens: 48, LoadAsync: true}, connector.Answer{}},
		{"params", connector.Query{NumTokens: 48, LoadAsync: true, Transfer: src},
			connector.Answer{Tokens: 32, Spec: &kvcore.LoadSpec{KVPoolCachedTokens: 32}, Async: true, PD: src}},
		{"computed covers the hit", connector.Query{NumTokens: 48, NumComputedTokens: 32, Transfer: src}, connector.Answer{}},
		{"sync", connector.Query{NumTokens: 48, NumComputedTokens: 16, Transfer: src},
			connector.Answer{Tokens: 16, Spec: &kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}, PD: src}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pd.Lookup(context.Background(), &tc.q)
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Lookup = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

func TestStoreChild(t *testing.T) {
	ctx := context.Background()
	m := denseModel()
	kb := kvcore.KeysOf(m).WithPrefix("unit")
	tokens := make([]uint32, 48)
	for i := range tokens {
		tokens[i] = uint32(i * 7)
	}
	hashes := kvcore.HashChain(tokens, 16, nil)
	mem := kvstore.NewMemory(kvstore.MemoryOptions{})
	if _, err := mem.Put(ctx, []kvstore.Item{{Key: kb.Key(kvcore.Rank{}, 0, hashes[0])}, {Key: kb.Key(kvcore.Rank{}, 0, hashes[1])}}); err != nil {
		t.Fatal(err)
	}
	s := connector.NewStore(m, kb, mem)
	got, err := s.Lookup(ctx, &connector.Query{NumTokens: 48, NumComputedTokens: 16, Hashes: hashes, LoadAsync: true})
	want := connector.Answer{Tokens: 16, Spec: &kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}, Async: true}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("Lookup = %+v, %v; want %+v", got, err, want)
	}
	if err := mem.Close(); err != nil {
		t.Fatal(err)
	}
	// A failed check fails open: 0 tokens, no spec, the failure carried in
	// the answer, and no error (the chain goes on).
	got, err = s.Lookup(ctx, &connector.Query{NumTokens: 48, Hashes: hashes, LoadAsync: true})
	if err != nil || got.Tokens != 0 || got.Spec != nil || got.Pending || got.Async ||
		!errors.Is(got.Failed, connector.ErrStore) || !errors.Is(got.Failed, kvstore.ErrClosed) {
		t.Fatalf("Lookup on a closed store = %+v, %v; want 0 with Failed wrapping ErrStore and ErrClosed, no error", got, err)
	}
	if r := got.FailureReason(); r != kvstore.StatusClosed {
		t.Fatalf("FailureReason = %q, want %q", r, kvstore.StatusClosed)
	}
	// A prompt shorter than a block needs no store call, even a closed one.
	if got, err := s.Lookup(ctx, &connector.Query{NumTokens: 12}); err != nil || got.Tokens != 0 || got.Spec != nil {
		t.Fatalf("12 tokens = %+v, %v; want 0, no spec, no error", got, err)
	}
}

// TestStoreChildPartialTailKeys: under partial hash hits (MLA 64 + Mamba
// 64, hash block 16) the store child's LoadSpec carries the tail keys of
// the hit (worker.py MooncakeStoreWorker._tail_key_boundaries). The store
// holds MLA's block 0 and its prompt tail at 96, and Mamba's state at 80:
// a 112-token request hits 80 inside block 1, MLA's last chunk is keyed at
// 96 (the later boundary of the block it stored), Mamba's at 80.
func TestStoreChildPartialTailKeys(t *testing.T) {
	ctx := context.Background()
	m := &kvcore.Model{Name: "partial-unit", HashBlockSize: 16, Groups: []kvcore.Group{
		{Kind: kvcore.KindMLA, BlockSize: 64, BytesPerBlock: 64},
		{Kind: kvcore.KindMamba, BlockSize: 64, BytesPerBlock: 64, MambaCacheMode: kvcore.MambaAlign},
	}}
	if err := m.Validate(); err != nil || !m.PartialHashHits() {
		t.Fatalf("model: %v, partial %v", err, m.PartialHashHits())
	}
	kb := kvcore.KeysOf(m).WithPrefix("unit")
	tokens := make([]uint32, 112)
	for i := range tokens {
		tokens[i] = uint32(i*11 + 3)
	}
	hashes := kvcore.HashChain(tokens, 16, nil)
	mem := kvstore.NewMemory(kvstore.MemoryOptions{})
	defer func() { _ = mem.Close() }()
	var items []kvstore.Item
	for _, k := range []struct{ g, h int }{{0, 3}, {0, 5}, {1, 3}, {1, 4}} {
		items = append(items, kvstore.Item{Key: kb.Key(kvcore.Rank{}, k.g, hashes[k.h])})
	}
	if _, err := mem.Put(ctx, items); err != nil {
		t.Fatal(err)
	}
	s := connector.NewStore(m, kb, mem)
	got, err := s.Lookup(ctx, &connector.Query{NumTokens: 112, NumComputedTokens: 0, Hashes: hashes})
	want := connector.Answer{Tokens: 80, Spec: &kvcore.LoadSpec{KVPoolCachedTokens: 80,
		TailKeys: []kvcore.TailKey{{Group: 0, Tokens: 96}, {Group: 1, Tokens: 80}}}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("Lookup = %+v (spec %+v), %v; want %+v (spec %+v)", got, got.Spec, err, want, want.Spec)
	}
	// Without partial hash hits the spec carries no tail keys.
	dense := denseModel()
	dkb := kvcore.KeysOf(dense).WithPrefix("unit")
	if _, err := mem.Put(ctx, []kvstore.Item{{Key: dkb.Key(kvcore.Rank{}, 0, hashes[0])}}); err != nil {
		t.Fatal(err)
	}
	got, err = connector.NewStore(dense, dkb, mem).Lookup(ctx, &connector.Query{NumTokens: 48, Hashes: hashes})
	if err != nil || got.Spec == nil || got.Spec.KVPoolCachedTokens != 16 || got.Spec.TailKeys != nil {
		t.Fatalf("dense Lookup = %+v, %v; want a hit of 16 without tail keys", got, err)
	}
}
