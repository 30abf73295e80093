package requeststate

import (
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestSaveTasksCarryTokens checks that every save task carries the
// admitted tokens its hash chain covers, [0, N) of complete hash blocks,
// a copy of the tracker's, and the request's LoRA adapter.
func TestSaveTasksCarryTokens(t *testing.T) {
	cases := []struct {
		name     string
		tokens   int // admitted tokens
		lora     string
		wantLens []int // tokens on the saves of [0,32) and [32,64)
	}{
		{"every block", 128, "sql-lora", []int{32, 64}},
		{"fewer tokens than the saves", 48, "", []int{32, 48}},
		{"no tokens", 0, "", []int{0, 0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := trkHybrid(t)
			tr := NewTracker(m, "e1", "r1")
			tr.OnAdmit(trkHashes(8), 128)
			tr.OnAdmitTokens(m, seqTokens(c.tokens), c.lora)
			first := tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 8), ids(10, 8))})
			second := tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64})
			saves := append(first.Saves, second.Saves...)
			if len(saves) != 2 {
				t.Fatalf("%d saves, want 2", len(saves))
			}
			for i, s := range saves {
				if !slices.Equal(s.TokenIDs, seqTokens(c.wantLens[i])) || s.LoraName != c.lora {
					t.Errorf("save %d [%d,%d): %d tokens, lora %q; want %d, %q", i, s.Start, s.End, len(s.TokenIDs), s.LoraName, c.wantLens[i], c.lora)
				}
				if v := kvcore.ValidateSave(m, nil, &s); !v[0].OK() || !v[1].OK() {
					t.Errorf("save %d invalid: %+v", i, v)
				}
			}
			if len(saves[0].TokenIDs) > 0 {
				saves[0].TokenIDs[0] = 99
				if tr.TokenIDs[0] == 99 {
					t.Error("a task's tokens alias the tracker's")
				}
			}
		})
	}
}

// TestOnAdmitTokensOnlyGrows checks that a shorter or equal list keeps
// the tokens held and a longer one appends its new tokens.
func TestOnAdmitTokensOnlyGrows(t *testing.T) {
	m := trkHybrid(t)
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmitTokens(m, seqTokens(32), "a")
	tr.OnAdmitTokens(m, seqTokens(16), "")
	if len(tr.TokenIDs) != 32 || tr.LoraName != "a" {
		t.Fatalf("after a shorter list: %d tokens, lora %q; want 32, a", len(tr.TokenIDs), tr.LoraName)
	}
	tr.OnAdmitTokens(m, seqTokens(48), "b")
	if !slices.Equal(tr.TokenIDs, seqTokens(48)) || tr.LoraName != "b" {
		t.Fatalf("after a longer list: %v, lora %q", tr.TokenIDs, tr.LoraName)
	}
}

// TestTokenPrefixBound checks the bound on the tokens a request keeps:
// the first MaxTokenIDs, rounded down to whole hash blocks.
func TestTokenPrefixBound(t *testing.T) {
	cases := []struct {
		name   string
		hbs, n int
		want   int
	}{
		{"under the bound", 16, 4096, 4096},
		{"at the bound", 16, kvcore.MaxTokenIDs, kvcore.MaxTokenIDs},
		{"over the bound", 16, kvcore.MaxTokenIDs + 64, kvcore.MaxTokenIDs},
		{"hash blocks that do not divide the bound", 48, kvcore.MaxTokenIDs/48*48 + 96, kvcore.MaxTokenIDs / 48 * 48},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := kvcore.TokenPrefix(c.hbs, seqTokens(c.n))
			if len(got) != c.want || got[len(got)-1] != uint32(c.want) || len(got)%c.hbs != 0 {
				t.Fatalf("TokenPrefix(%d, %d tokens): %d tokens, want the first %d", c.hbs, c.n, len(got), c.want)
			}
		})
	}
	m := trkHybrid(t)
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmitTokens(m, seqTokens(kvcore.MaxTokenIDs+16), "")
	if len(tr.TokenIDs) != kvcore.MaxTokenIDs {
		t.Fatalf("the tracker keeps %d tokens, want %d", len(tr.TokenIDs), kvcore.MaxTokenIDs)
	}
}
