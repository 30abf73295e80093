package sim

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// longContextPrompts checks every prompt of w against the long-context
// bounds and returns the prompt lengths, the distinct system prompts
// (documents) and how many conversations share one with an earlier one.
func longContextPrompts(t *testing.T, w Workload) (lengths []int, documents, shared int) {
	t.Helper()
	convs, err := Generate(w)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{} // by system prompt length: the documents are distinct draws
	for _, c := range convs {
		if seen[len(c.System)] {
			shared++
		}
		seen[len(c.System)] = true
		for turn := range c.Turns {
			n := len(c.Prompt(turn))
			if n < LongContextMinPrompt || n > LongContextMaxPrompt {
				t.Fatalf("conversation %d turn %d: a %d-token prompt, outside [%d, %d]", c.Index, turn, n, LongContextMinPrompt, LongContextMaxPrompt)
			}
			lengths = append(lengths, n)
		}
	}
	return lengths, len(seen), shared
}

// TestLongContextPreset: every prompt of the long-context preset, whatever
// the seed, is 8K-32K tokens, spread over that range; conversations share
// documents (so lookups can hit); the pool holds the longest request with
// the watermark, and the step budget is below the prompts, so prefill is
// chunked over several steps.
func TestLongContextPreset(t *testing.T) {
	p, ok := LookupPreset("long-context")
	if !ok {
		t.Fatal("no long-context preset")
	}
	m, err := kvcore.Preset(p.Model)
	if err != nil {
		t.Fatal(err)
	}
	lo, hi := LongContextMaxPrompt, 0
	for seed := range uint64(20) {
		w := p.Workload
		w.Seed += seed
		lengths, docs, shared := longContextPrompts(t, w)
		if len(lengths) != w.Requests || docs < 2 || shared == 0 {
			t.Fatalf("seed %d: %d prompts, %d documents, %d conversations sharing one: want %d prompts and shared documents", w.Seed, len(lengths), docs, shared, w.Requests)
		}
		for _, n := range lengths {
			lo, hi = min(lo, n), max(hi, n)
		}
	}
	if lo > 12<<10 || hi < 28<<10 {
		t.Fatalf("prompts span [%d, %d]: want them spread over 8K-32K", lo, hi)
	}
	longest := p.Workload.SystemTokens.Max + 2*p.Workload.UserTokens.Max + p.Workload.OutputTokens.Max + p.Workload.OutputTokens.Max
	e := newEngine("e", RoleBoth, p.Engine, engineDeps{model: m, stats: newStats()}, engineHooks{})
	if _, need, ok := e.everFits(longest); !ok {
		t.Fatalf("the longest request (%d tokens, %d blocks) does not fit the preset's pool %+v", longest, need, p.Engine)
	}
	if p.Engine.MaxBatchTokens >= LongContextMinPrompt || p.WorkerPoolBlocks < p.Engine.PoolBlocks {
		t.Fatalf("engine %+v, worker pool %d: want a step budget below the shortest prompt and workers holding the pool", p.Engine, p.WorkerPoolBlocks)
	}
}

// TestPresetsAreValid: every listed preset exists, names a shipped model
// and has a valid workload and engine sizes.
func TestPresetsAreValid(t *testing.T) {
	names := PresetNames()
	if len(names) != len(Presets()) || names[0] != "seed" {
		t.Fatalf("preset names %v for %d presets", names, len(Presets()))
	}
	for _, name := range names {
		p, ok := LookupPreset(name)
		if !ok {
			t.Fatalf("%s is listed, not defined", name)
		}
		if _, err := kvcore.Preset(p.Model); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if err := p.Workload.Validate(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if p.Summary == "" || p.Engine.MaxBatchTokens < 1 || p.Engine.MaxRunning < 1 || p.Engine.Watermark >= p.Engine.PoolBlocks {
			t.Errorf("%s: %+v", name, p)
		}
	}
	if _, ok := LookupPreset("nope"); ok {
		t.Fatal("an unknown preset was found")
	}
}

// TestEngineFor: conversations go round robin over the engines, every
// engine gets its share, and a single engine (or none) gets them all.
func TestEngineFor(t *testing.T) {
	counts := make([]int, 3)
	for c := range 30 {
		i := EngineFor(c, 3)
		if i != c%3 {
			t.Fatalf("conversation %d on engine %d, want %d", c, i, c%3)
		}
		counts[i]++
	}
	for i, n := range counts {
		if n != 10 {
			t.Fatalf("engine %d got %d of 30 conversations", i, n)
		}
	}
	for _, tc := range [][2]int{{5, 1}, {5, 0}, {-1, 3}} {
		if i := EngineFor(tc[0], tc[1]); i != 0 {
			t.Fatalf("EngineFor(%d, %d) = %d, want 0", tc[0], tc[1], i)
		}
	}
}
