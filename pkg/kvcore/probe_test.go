package kvcore

import (
	"math/rand/v2"
	"testing"
)

// probeAll runs Probe to its end against a lower tier that holds lower[i],
// as a two-tier store's Exists does, and returns the answers and how many
// keys the lower tier was asked about.
func probeAll(p *LookupPlan, upper, lower []bool) ([]bool, int) {
	found := append([]bool(nil), upper...)
	tried := make([]bool, len(found))
	asked := 0
	for range len(found) + 1 {
		next := p.Probe(found, tried, 8)
		if len(next) == 0 {
			break
		}
		for _, i := range next {
			if tried[i] || found[i] {
				panic("Probe asked again about a key it knows")
			}
			tried[i] = true
			asked++
			found[i] = lower[i]
		}
	}
	return found, asked
}

// TestProbeKeepsEveryHit: whatever the two tiers hold, the hit found
// through Probe is the hit of every key asked about — Probe never loses a
// hit — and a prompt neither tier holds costs one small round.
func TestProbeKeepsEveryHit(t *testing.T) {
	const numTokens = 4096
	tests := []struct {
		preset string
		// coldMax bounds the keys asked about when neither tier holds any.
		coldMax int
	}{
		{"dense", 8},
		{"hybrid-mla-linear", 8},
		{"hybrid-mla-linear-tp8", 8 * 8},
		{"full-swa-mamba", 8},
		{"hybrid-mla-linear-partial", -1}, // partial hash hits: every key asked
	}
	for _, tt := range tests {
		t.Run(tt.preset, func(t *testing.T) {
			m, err := Preset(tt.preset)
			if err != nil {
				t.Fatal(err)
			}
			kb := KeyBuilder{Model: m.Name}
			p, err := PlanLookup(m, kb, promptHashes(m, numTokens, 1), numTokens)
			if err != nil {
				t.Fatal(err)
			}
			n := len(p.Keys())
			none := make([]bool, n)
			_, asked := probeAll(p, none, none)
			if tt.coldMax >= 0 && asked > tt.coldMax {
				t.Fatalf("a prompt no tier holds: %d of %d keys asked about, want at most %d", asked, n, tt.coldMax)
			}
			if tt.coldMax < 0 && asked != n {
				t.Fatalf("partial hash hits: %d of %d keys asked about, want all", asked, n)
			}
			rng := rand.New(rand.NewPCG(7, uint64(n)))
			long := 0 // rounds whose hit needs more than the first window
			for round := range 200 {
				upper, lower, union := make([]bool, n), make([]bool, n), make([]bool, n)
				// A prefix of the prompt is stored, each key in either tier
				// or both; some keys of the prefix are lost in both.
				stored := rng.IntN(n + 1)
				for i := range n {
					if i >= stored && round%2 == 0 {
						continue
					}
					upper[i], lower[i] = rng.IntN(3) == 0, rng.IntN(64) != 0
					union[i] = upper[i] || lower[i]
				}
				got, _ := probeAll(p, upper, lower)
				for i := range n {
					if got[i] && !union[i] {
						t.Fatalf("round %d: key %d counts present, held by neither tier", round, i)
					}
				}
				want, have := p.Hit(union, numTokens), p.Hit(got, numTokens)
				if have != want {
					t.Fatalf("round %d: hit %d through Probe, %d with every key asked", round, have, want)
				}
				if want > 8*m.SchedulerBlockSize() {
					long++
				}
			}
			if long < 10 {
				t.Fatalf("only %d of 200 rounds hit past the first window: the test does not exercise Probe's rounds", long)
			}
		})
	}
}
