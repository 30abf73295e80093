package kvcore

import (
	"encoding/json"
	"reflect"
	"testing"
)

func TestSelectChild(t *testing.T) {
	cases := []struct {
		name     string
		children []ChildAnswer
		want     Selection
		wantName string
	}{
		{"first positive wins", []ChildAnswer{{Name: "pd", Tokens: 0}, {Name: "store", Tokens: 32}}, Selection{Chosen: 1, Tokens: 32}, "store"},
		{"order decides a tie", []ChildAnswer{{Name: "pd", Tokens: 32}, {Name: "store", Tokens: 48}}, Selection{Chosen: 0, Tokens: 32}, "pd"},
		{"pending anywhere is not yet", []ChildAnswer{{Name: "pd", Tokens: 32}, {Name: "store", Pending: true}}, Selection{Pending: true, Chosen: NoChild}, ""},
		{"nobody has tokens", []ChildAnswer{{Name: "pd"}, {Name: "store"}}, Selection{Chosen: NoChild}, ""},
		{"no children", nil, Selection{Chosen: NoChild}, ""},
		{"negative counts are not hits", []ChildAnswer{{Name: "pd", Tokens: -5}, {Name: "store", Tokens: 16}}, Selection{Chosen: 1, Tokens: 16}, "store"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := SelectChild(c.children)
			if got != c.want || got.Name(c.children) != c.wantName {
				t.Fatalf("selection %+v (%q), want %+v (%q)", got, got.Name(c.children), c.want, c.wantName)
			}
		})
	}
}

func TestAllocationCounts(t *testing.T) {
	children := []ChildAnswer{{Name: "pd"}, {Name: "store"}, {Name: "other"}}
	cases := []struct {
		chosen int
		want   []int
	}{
		{0, []int{48, 0, 0}},
		{2, []int{0, 0, 48}},
		{NoChild, []int{0, 0, 0}},
		{7, []int{0, 0, 0}},
	}
	for _, c := range cases {
		if got := AllocationCounts(c.chosen, children, 48); !reflect.DeepEqual(got, c.want) {
			t.Fatalf("chosen %d: %v, want %v", c.chosen, got, c.want)
		}
	}
}

func TestFinishGate(t *testing.T) {
	if g := NewFinishGate(nil); !g.Done() {
		t.Fatal("a gate with no async child must be done at once")
	}
	g := NewFinishGate([]string{"pd", "store", "pd"})
	if g.Done() || len(g.Waiting) != 2 {
		t.Fatalf("gate %+v", g)
	}
	if g.Report("store") || g.Report("store") || g.Report("nobody") {
		t.Fatal("finished before every child reported")
	}
	b, err := json.Marshal(g)
	if err != nil {
		t.Fatal(err)
	}
	var back FinishGate
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !back.Report("pd") || !back.Done() {
		t.Fatal("last report did not finish the restored gate")
	}
	if back.Report("pd") {
		t.Fatal("finished twice")
	}
}
