package kvcore

import (
	"testing"
)

// fuzzPresets loads every shipped preset, in PresetNames order.
func fuzzPresets(t testing.TB) []*Model {
	t.Helper()
	var out []*Model
	for _, name := range PresetNames() {
		m, err := Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// checkVerdicts asserts the shape of ValidateSave's answer: one verdict per
// model group in order, then one per out-of-range or duplicate entry.
func checkVerdicts(t *testing.T, m *Model, task *SaveTask, vs []GroupVerdict) {
	t.Helper()
	var extra []GroupVerdict
	seen := map[int]bool{}
	for _, e := range task.Groups {
		switch {
		case e.Group < 0 || e.Group >= len(m.Groups):
			extra = append(extra, GroupVerdict{Group: e.Group, Reason: ReasonGroupOutOfRange})
		case seen[e.Group]:
			extra = append(extra, GroupVerdict{Group: e.Group, Reason: ReasonGroupDuplicate})
		}
		seen[e.Group] = true
	}
	if len(vs) != len(m.Groups)+len(extra) {
		t.Fatalf("%d verdicts for %d groups and %d extra entries: %+v", len(vs), len(m.Groups), len(extra), vs)
	}
	for g := range m.Groups {
		if vs[g].Group != g {
			t.Fatalf("verdict %d names group %d", g, vs[g].Group)
		}
		if !vs[g].OK() && vs[g].Detail == "" {
			t.Fatalf("group %d: %s without detail", g, vs[g].Reason)
		}
	}
	for i, e := range extra {
		if v := vs[len(m.Groups)+i]; v.Group != e.Group || v.Reason != e.Reason {
			t.Fatalf("extra verdict %d = %+v, want %+v", i, v, e)
		}
	}
}
