package kvcore

import (
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// lookupModel is a valid test model named "test-model" with the given hash
// block size and groups (bytes_per_block filled in).
func lookupModel(hashBS int, groups ...Group) *Model {
	m := &Model{Name: "test-model", HashBlockSize: hashBS}
	for _, g := range groups {
		if g.BytesPerBlock == 0 {
			g.BytesPerBlock = 1024
		}
		m.Groups = append(m.Groups, g)
	}
	return m
}

func grpFull(bs int) Group  { return Group{Kind: KindFullAttention, BlockSize: bs} }
func grpMLA(bs int) Group   { return Group{Kind: KindMLA, BlockSize: bs} }
func grpMamba(bs int) Group { return Group{Kind: KindMamba, BlockSize: bs} }
func grpSWA(bs, window int) Group {
	return Group{Kind: KindSlidingWindow, BlockSize: bs, Window: window}
}

func TestModelValidate(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(m *Model)
		field string // "" means valid
	}{
		{"valid", func(m *Model) {}, ""},
		{"empty name", func(m *Model) { m.Name = " " }, "name"},
		{"at in name", func(m *Model) { m.Name = "a@b" }, "name"},
		{"space in name", func(m *Model) { m.Name = "a b" }, "name"},
		{"zero hash block", func(m *Model) { m.HashBlockSize = 0 }, "hash_block_size"},
		{"no groups", func(m *Model) { m.Groups = nil }, "groups"},
		{"unknown kind", func(m *Model) { m.Groups[1].Kind = "flash" }, "groups[1].kind"},
		{"window on full", func(m *Model) { m.Groups[0].Window = 8 }, "groups[0].window"},
		{"swa without window", func(m *Model) { m.Groups[1].Window = 0 }, "groups[1].window"},
		{"zero block size", func(m *Model) { m.Groups[2].BlockSize = 0 }, "groups[2].block_size"},
		{"block not multiple of hash", func(m *Model) { m.Groups[0].BlockSize = 24 }, "groups[0].block_size"},
		{"zero bytes per block", func(m *Model) { m.Groups[2].BytesPerBlock = 0 }, "groups[2].bytes_per_block"},
		{"negative tp", func(m *Model) { m.Parallel.TP = -1 }, "parallel.tp"},
		{"negative pcp", func(m *Model) { m.Parallel.PCP = -1 }, "parallel.pcp"},
		{"negative dcp", func(m *Model) { m.Parallel.DCP = -2 }, "parallel.dcp"},
		{"negative pp", func(m *Model) { m.Parallel.PP = -1 }, "parallel.pp"},
		{"kv dtype", func(m *Model) { m.KVDtype = "fp8_e4m3" }, ""},
		{"space in kv dtype", func(m *Model) { m.KVDtype = "fp8 e4m3" }, "kv_dtype"},
		{"long kv dtype", func(m *Model) { m.KVDtype = strings.Repeat("a", 65) }, "kv_dtype"},
		{"engine version", func(m *Model) { m.EngineVersion = "0.11.2+cu128" }, ""},
		{"at in engine version", func(m *Model) { m.EngineVersion = "0.11@2" }, "engine_version"},
		{"negative layout version", func(m *Model) { m.LayoutVersion = -1 }, "layout_version"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := lookupModel(16, grpFull(16), grpSWA(32, 64), grpMamba(16))
			tc.edit(m)
			err := m.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			var se *SpecError
			if !errors.As(err, &se) {
				t.Fatalf("Validate() = %v, want *SpecError", err)
			}
			if se.Field != tc.field || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("Validate() field %q (%v), want %q", se.Field, err, tc.field)
			}
		})
	}
}

func TestParseModel(t *testing.T) {
	want := &Model{
		Name:          "m",
		HashBlockSize: 16,
		Groups: []Group{
			{Kind: KindMLA, BlockSize: 16, BytesPerBlock: 100},
			{Kind: KindSlidingWindow, BlockSize: 32, Window: 64, BytesPerBlock: 200},
		},
		Parallel: Parallel{TP: 2, PP: 2},
	}
	cases := []struct {
		name    string
		in      string
		want    *Model
		wantErr bool
		spec    bool // the error is a *SpecError
	}{
		{"json", `{"name":"m","hash_block_size":16,"groups":[{"kind":"mla","block_size":16,"bytes_per_block":100},
			{"kind":"sliding_window","block_size":32,"window":64,"bytes_per_block":200}],"parallel":{"tp":2,"pp":2}}`, want, false, false},
		{"yaml", "name: m\nhash_block_size: 16\ngroups:\n  - {kind: mla, block_size: 16, bytes_per_block: 100}\n" +
			"  - {kind: sliding_window, block_size: 32, window: 64, bytes_per_block: 200}\nparallel: {tp: 2, pp: 2}\n", want, false, false},
		{"json unknown field", `{"name":"m","hash_block_size":16,"colour":"red","groups":[{"kind":"mla","block_size":16,"bytes_per_block":1}]}`, nil, true, false},
		{"json unknown group field", `{"name":"m","hash_block_size":16,"groups":[{"kind":"mla","block_size":16,"bytes_per_block":1,"heads":8}]}`, nil, true, false},
		{"yaml unknown field", "name: m\nhash_block_size: 16\ncolour: red\ngroups:\n  - {kind: mla, block_size: 16, bytes_per_block: 1}\n", nil, true, false},
		{"yaml unknown parallel field", "name: m\nhash_block_size: 16\ngroups:\n  - {kind: mla, block_size: 16, bytes_per_block: 1}\nparallel: {ep: 2}\n", nil, true, false},
		{"json invalid spec", `{"name":"m","hash_block_size":16,"groups":[]}`, nil, true, true},
		{"yaml invalid spec", "name: m\nhash_block_size: 16\ngroups:\n  - {kind: mamba, block_size: 8, bytes_per_block: 1}\n", nil, true, true},
		{"json syntax", `{"name":`, nil, true, false},
		{"empty", ``, nil, true, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseModel([]byte(tc.in))
			if tc.wantErr {
				if err == nil {
					t.Fatalf("ParseModel = %+v, want error", got)
				}
				var se *SpecError
				if errors.As(err, &se) != tc.spec {
					t.Fatalf("ParseModel error %v: *SpecError = %v, want %v", err, !tc.spec, tc.spec)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseModel: %v", err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("ParseModel = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestPresets(t *testing.T) {
	names := PresetNames()
	if want := []string{"dense", "full-swa-mamba", "hybrid-mla-linear", "hybrid-mla-linear-partial", "hybrid-mla-linear-tp8"}; !slices.Equal(names, want) {
		t.Fatalf("PresetNames() = %v, want %v", names, want)
	}
	sbs := map[string]int{"dense": 16, "full-swa-mamba": 32, "hybrid-mla-linear": 16, "hybrid-mla-linear-partial": 64, "hybrid-mla-linear-tp8": 16}
	partial := map[string]bool{"hybrid-mla-linear-partial": true}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			m, err := Preset(name)
			if err != nil {
				t.Fatalf("Preset(%q): %v", name, err)
			}
			if err := m.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if got := m.SchedulerBlockSize(); got != sbs[name] {
				t.Fatalf("SchedulerBlockSize = %d, want %d", got, sbs[name])
			}
			if got := m.PartialHashHits(); got != partial[name] {
				t.Fatalf("PartialHashHits = %v, want %v", got, partial[name])
			}
			m.Groups[0].BlockSize = 999
			again, err := Preset(name)
			if err != nil || again.Groups[0].BlockSize == 999 {
				t.Fatalf("Preset(%q) shares state between calls (err %v)", name, err)
			}
		})
	}
	if _, err := Preset("nope"); !errors.Is(err, ErrUnknownModel) {
		t.Fatalf("Preset(nope) = %v, want ErrUnknownModel", err)
	}
}

func TestSchedulerBlockSize(t *testing.T) {
	cases := []struct {
		name   string
		groups []Group
		want   int
	}{
		{"one group", []Group{grpFull(16)}, 16},
		{"equal", []Group{grpFull(16), grpMamba(16)}, 16},
		{"multiple", []Group{grpFull(32), grpSWA(8, 8)}, 32},
		{"lcm", []Group{grpFull(48), grpSWA(32, 64), grpMamba(16)}, 96},
	}
	for _, tc := range cases {
		if got := lookupModel(8, tc.groups...).SchedulerBlockSize(); got != tc.want {
			t.Errorf("%s: SchedulerBlockSize = %d, want %d", tc.name, got, tc.want)
		}
	}
}

func TestFingerprint(t *testing.T) {
	a := lookupModel(16, grpFull(16))
	b := lookupModel(16, grpFull(16))
	if a.Fingerprint() != b.Fingerprint() {
		t.Fatal("equal models have different fingerprints")
	}
	if len(a.Fingerprint()) != 16 {
		t.Fatalf("fingerprint %q is not 16 hex digits", a.Fingerprint())
	}
	b.Groups[0].BytesPerBlock++
	if a.Fingerprint() == b.Fingerprint() {
		t.Fatal("models differing in bytes_per_block share a fingerprint")
	}
}

// TestFingerprintCovers: every field that decides a block's bytes changes
// the fingerprint (so a layout change is another key: a miss), and the
// defaults read as the values they stand for.
func TestFingerprintCovers(t *testing.T) {
	base := func() *Model { return lookupModel(16, grpFull(16), grpSWA(32, 64)) }
	fp := base().Fingerprint()
	changes := []struct {
		name string
		edit func(m *Model)
	}{
		{"name", func(m *Model) { m.Name = "other" }},
		{"kv dtype", func(m *Model) { m.KVDtype = "fp8_e4m3" }},
		{"layout version", func(m *Model) { m.LayoutVersion = 2 }},
		{"engine version", func(m *Model) { m.EngineVersion = "0.11.2" }},
		{"hash block size", func(m *Model) { m.HashBlockSize = 8 }},
		{"block size", func(m *Model) { m.Groups[0].BlockSize = 32 }},
		{"window", func(m *Model) { m.Groups[1].Window = 128 }},
		{"kind", func(m *Model) { m.Groups[0].Kind = KindMLA }},
		{"bytes per block", func(m *Model) { m.Groups[1].BytesPerBlock = 2048 }},
		{"kv heads", func(m *Model) { m.KVHeads = 2 }},
		{"tp", func(m *Model) { m.Parallel.TP = 2 }},
	}
	seen := map[string]string{fp: "base"}
	for _, c := range changes {
		m := base()
		c.edit(m)
		got := m.Fingerprint()
		if prev, dup := seen[got]; dup {
			t.Errorf("changing the %s gives fingerprint %s, the same as %s", c.name, got, prev)
		}
		seen[got] = c.name
	}
	same := []struct {
		name string
		edit func(m *Model)
	}{
		{"kv dtype auto", func(m *Model) { m.KVDtype = DefaultKVDtype }},
		{"layout version 1", func(m *Model) { m.LayoutVersion = DefaultLayoutVersion }},
	}
	for _, c := range same {
		m := base()
		c.edit(m)
		if got := m.Fingerprint(); got != fp {
			t.Errorf("%s: fingerprint %s, want the default's %s", c.name, got, fp)
		}
	}
}

func TestRankStringAndJSON(t *testing.T) {
	r := Rank{TP: 1, PCP: 2, DCP: 3, PP: 4}
	if got := r.String(); got != "tp1-pcp2-dcp3-pp4" {
		t.Errorf("String() = %q", got)
	}
	b, err := json.Marshal(r)
	if err != nil || string(b) != `{"tp":1,"pcp":2,"dcp":3,"pp":4}` {
		t.Errorf("json = %s, %v", b, err)
	}
}

func TestCheckEngineVersion(t *testing.T) {
	pinned := lookupModel(16, grpFull(16))
	pinned.EngineVersion = "0.11.2"
	open := lookupModel(16, grpFull(16))
	cases := []struct {
		name   string
		m      *Model
		stated string
		want   error
	}{
		{"pinned, same", pinned, "0.11.2", nil},
		{"pinned, not stated", pinned, "", nil},
		{"pinned, another", pinned, "0.12.0", ErrEngineVersion},
		{"not pinned, any", open, "0.12.0+cu128", nil},
		{"not pinned, not stated", open, "", nil},
		{"malformed", open, "0.12 rc1", ErrBadEngineVersion},
		{"too long", pinned, strings.Repeat("9", 65), ErrBadEngineVersion},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.m.CheckEngineVersion(tc.stated)
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("CheckEngineVersion(%q) = %v, want %v", tc.stated, err, tc.want)
			}
		})
	}
}
