package sim

import (
	"errors"
	"reflect"
	"slices"
	"testing"
	"time"
)

func testWorkload() Workload {
	return Workload{
		Requests: 25, Turns: Range{2, 4}, SystemPrompts: 3, SystemTokens: Range{32, 64},
		UserTokens: Range{4, 16}, OutputTokens: Range{2, 8}, Rate: 10, Seed: 7, Vocab: 1000,
	}
}

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    Range
		wantErr bool
	}{
		{"5", Range{5, 5}, false},
		{"16-128", Range{16, 128}, false},
		{" 0-0 ", Range{0, 0}, false},
		{"9-3", Range{}, true},
		{"-3", Range{}, true},
		{"a-b", Range{}, true},
		{"", Range{}, true},
	} {
		got, err := ParseRange(tc.in)
		if (err != nil) != tc.wantErr || (err == nil && got != tc.want) {
			t.Errorf("ParseRange(%q) = %v, %v; want %v, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
		if err != nil && !errors.Is(err, ErrWorkload) {
			t.Errorf("ParseRange(%q): %v does not wrap ErrWorkload", tc.in, err)
		}
		if err == nil {
			if back, _ := ParseRange(got.String()); back != got {
				t.Errorf("%v does not round-trip through String: %v", got, back)
			}
		}
	}
}

func TestWorkloadValidate(t *testing.T) {
	for name, mutate := range map[string]func(*Workload){
		"no requests":      func(w *Workload) { w.Requests = 0 },
		"no turns":         func(w *Workload) { w.Turns = Range{0, 2} },
		"no system prompt": func(w *Workload) { w.SystemPrompts = 0 },
		"empty user turn":  func(w *Workload) { w.UserTokens = Range{0, 3} },
		"empty reply":      func(w *Workload) { w.OutputTokens = Range{0, 0} },
		"negative rate":    func(w *Workload) { w.Rate = -1 },
		"negative think":   func(w *Workload) { w.ThinkTime = -time.Second },
		"tiny vocab":       func(w *Workload) { w.Vocab = 1 },
		"reversed range":   func(w *Workload) { w.SystemTokens = Range{9, 3} },
	} {
		w := testWorkload()
		mutate(&w)
		if err := w.Validate(); !errors.Is(err, ErrWorkload) {
			t.Errorf("%s: Validate() = %v, want ErrWorkload", name, err)
		}
	}
	if err := testWorkload().Validate(); err != nil {
		t.Fatalf("valid workload: %v", err)
	}
}

func TestGenerate(t *testing.T) {
	w := testWorkload()
	a, err := Generate(w)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Generate(w)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed generated two different workloads")
	}
	w.Seed++
	if c, _ := Generate(w); reflect.DeepEqual(a, c) {
		t.Fatal("another seed generated the same workload")
	}
	total, systems := 0, map[int]bool{}
	for i, c := range a {
		total += len(c.Turns)
		if c.Index != i || (i > 0 && c.Start < a[i-1].Start) {
			t.Fatalf("conversation %d: index %d, start %v after %v", i, c.Index, c.Start, a[max(0, i-1)].Start)
		}
		systems[len(c.System)] = true
		for turn := range c.Turns {
			p := c.Prompt(turn)
			if !slices.Equal(p[:len(c.System)], c.System) {
				t.Fatalf("conversation %d turn %d does not start with its system prompt", i, turn)
			}
			if turn > 0 {
				prev := c.Prompt(turn - 1)
				if !slices.Equal(p[:len(prev)], prev) || !slices.Equal(p[len(prev):len(prev)+len(c.Turns[turn-1].Output)], c.Turns[turn-1].Output) {
					t.Fatalf("conversation %d turn %d does not extend turn %d with its reply", i, turn, turn-1)
				}
			}
		}
	}
	if total != w.Requests {
		t.Fatalf("%d turns, want %d", total, w.Requests)
	}
	if len(systems) < 2 {
		t.Fatalf("conversations share %d system prompt length(s); want several prompts", len(systems))
	}
}

func TestGenerateAllAtOnce(t *testing.T) {
	w := testWorkload()
	w.Rate = 0
	convs, err := Generate(w)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range convs {
		if c.Start != 0 {
			t.Fatalf("rate 0: conversation %d starts at %v", c.Index, c.Start)
		}
	}
}
