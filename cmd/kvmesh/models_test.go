package main

import (
	"bytes"
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// servedModels is what GET /v1/models answers for a mesh of these presets
// (the first the default, at tp over its spec's when tp is not 0).
func servedModels(t *testing.T, tp int, presets ...string) adminapi.ServedModels {
	t.Helper()
	var ms []*kvcore.Model
	for i, p := range presets {
		m, err := service.LoadModel(p)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if err := (service.ParallelOverride{TP: tp}).Apply(m); err != nil {
				t.Fatal(err)
			}
		}
		ms = append(ms, m)
	}
	r, err := kvcore.NewModels("", ms...)
	if err != nil {
		t.Fatal(err)
	}
	return adminapi.DescribeModels(r)
}

// sameJSON fails t unless got (JSON) encodes as want does.
func sameJSON(t *testing.T, step string, got []byte, want any) {
	t.Helper()
	var decoded adminapi.ServedModels
	if err := json.Unmarshal(got, &decoded); err != nil {
		t.Fatalf("%s: stdout is not the JSON of the served models: %v", step, err)
	}
	g, err := json.Marshal(decoded)
	if err != nil {
		t.Fatal(err)
	}
	w, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(g, w) {
		t.Errorf("%s: --json\n%s\nwant\n%s", step, g, w)
	}
}

// TestModelsCommand runs kvmesh models against real services (subprocesses
// on a fresh database): a lookup, a scheduler and a sender serving
// hybrid-mla-linear (the default) and, through KVMESH_MODELS, dense and
// full-swa-mamba, and a second lookup that serves dense only beside a
// default at TP2 (another fingerprint). It checks the table and --json of
// each service, --check on a mesh that agrees (exit 0) and on one that
// does not (exit 1, naming the model missing on the lookup and the
// default's two fingerprints), an unreachable service and a missing token.
func TestModelsCommand(t *testing.T) {
	t.Setenv("KVMESH_ADMIN_TOKEN", "") // the steps pass --token explicitly
	m := meshtest.New(t, "climodels", "KVMESH_MODEL=hybrid-mla-linear", "KVMESH_MODELS=dense,full-swa-mamba",
		"KVMESH_KAFKA_PARTITIONS=2", "KVMESH_LOG_LEVEL=info", "KVMESH_SHUTDOWN_TIMEOUT=3s")
	if _, err := m.Start("scheduler", "scheduler", "KVMESH_MIGRATE=true"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, p := range [][]string{{"lookup", "lookup"}, {"sender", "sender"},
		{"lookup-other", "lookup", "KVMESH_MODELS=dense", "KVMESH_TP=2"}} {
		wg.Go(func() {
			if _, err := m.Start(p[0], p[1], p[2:]...); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	url := func(name string) string { return m.Procs.Process(name).URL() }
	tokenless := []string{"--lookup-url", url("lookup"), "--scheduler-url", url("scheduler"), "--sender-url", url("sender"), "--timeout", "20s"}
	flags := slices.Concat(tokenless, []string{"--token", m.AdminToken})

	want := servedModels(t, 0, "hybrid-mla-linear", "dense", "full-swa-mamba")
	other := servedModels(t, 2, "hybrid-mla-linear", "dense")
	fp := map[string]string{}
	for _, s := range want.Items {
		fp[s.Name] = s.Fingerprint
	}
	otherFP := other.Items[0].Fingerprint
	if otherFP == fp["hybrid-mla-linear"] {
		t.Fatalf("TP2 keeps the fingerprint %s: the test cannot tell the lookups apart", otherFP)
	}
	table := [][]string{
		{"hybrid-mla-linear", "yes", fp["hybrid-mla-linear"], "1", "tp1", "mla/16,mamba/16"},
		{"dense-8b", "no", fp["dense-8b"], "1", "tp1", "full_attention/16"},
		{"full-swa-mamba", "no", fp["full-swa-mamba"], "1", "tp1", "full_attention/16,sliding_window/32:w128,mamba/16"},
	}
	matrix := [][]string{
		{"hybrid-mla-linear", fp["hybrid-mla-linear"], "(default)", fp["hybrid-mla-linear"], "(default)", fp["hybrid-mla-linear"], "(default)"},
		{"dense-8b", fp["dense-8b"], fp["dense-8b"], fp["dense-8b"]},
		{"full-swa-mamba", fp["full-swa-mamba"], fp["full-swa-mamba"], fp["full-swa-mamba"]},
	}
	steps := []struct {
		name   string
		args   []string // after models and the common flags
		token  bool
		code   int
		rows   [][]string             // the table's rows, when not nil
		json   *adminapi.ServedModels // what --json must encode as, when not nil
		stderr []string
	}{
		{name: "lookup", token: true, rows: table},
		{name: "lookup json", args: []string{"--json"}, token: true, json: &want},
		{name: "scheduler", args: []string{"--service", "scheduler"}, token: true, rows: table},
		{name: "scheduler json", args: []string{"--service", "scheduler", "--json"}, token: true, json: &want},
		{name: "sender json", args: []string{"--json", "--service", "sender"}, token: true, json: &want},
		{name: "the other lookup", args: []string{"--lookup-url", url("lookup-other")}, token: true, rows: [][]string{
			{"hybrid-mla-linear", "yes", otherFP, "2", "tp2", "mla/16,mamba/16"},
			{"dense-8b", "no", fp["dense-8b"], "1", "tp1", "full_attention/16"},
		}},
		{name: "check", args: []string{"--check"}, token: true, rows: matrix,
			stderr: []string{"lookup, scheduler and sender serve the same 3 model(s)"}},
		{name: "check, a lookup that differs", args: []string{"--check", "--lookup-url", url("lookup-other")}, token: true, code: 1,
			rows: [][]string{
				{"hybrid-mla-linear", otherFP, "(default)", fp["hybrid-mla-linear"], "(default)", fp["hybrid-mla-linear"], "(default)"},
				{"dense-8b", fp["dense-8b"], fp["dense-8b"], fp["dense-8b"]},
				{"full-swa-mamba", "-", fp["full-swa-mamba"], fp["full-swa-mamba"]},
			},
			stderr: []string{
				"the services do not serve the same models",
				`model "hybrid-mla-linear": fingerprint ` + otherFP + " on lookup, " + fp["hybrid-mla-linear"] + " on scheduler and sender",
				`model "full-swa-mamba": served by scheduler and sender, not by lookup`,
			}},
		{name: "check, a sender not there", args: []string{"--check", "--sender-url", "http://127.0.0.1:1"}, token: true, code: 1,
			rows: [][]string{
				{"hybrid-mla-linear", fp["hybrid-mla-linear"], "(default)", fp["hybrid-mla-linear"], "(default)", "unreachable"},
				{"dense-8b", fp["dense-8b"], fp["dense-8b"], "unreachable"},
				{"full-swa-mamba", fp["full-swa-mamba"], fp["full-swa-mamba"], "unreachable"},
			},
			stderr: []string{"sender at http://127.0.0.1:1 is not reachable"}},
		{name: "no token", code: 1, stderr: []string{"pass --token"}},
	}
	for _, s := range steps {
		common := tokenless
		if s.token {
			common = flags
		}
		// The step's flags last: they override the common ones.
		r := runCLI(t, slices.Concat([]string{"models"}, common, s.args)...)
		if r.code != s.code {
			t.Fatalf("%s: exit %d, want %d; stderr:\n%s", s.name, r.code, s.code, r.stderr)
		}
		for _, w := range s.stderr {
			if !strings.Contains(r.stderr, w) {
				t.Errorf("%s: stderr %q lacks %q", s.name, r.stderr, w)
			}
		}
		if s.rows != nil && !reflect.DeepEqual(r.rows(), s.rows) {
			t.Errorf("%s: rows\n%q\nwant\n%q", s.name, r.rows(), s.rows)
		}
		if s.json != nil {
			sameJSON(t, s.name, []byte(r.stdout), s.json)
		}
	}

	// --check --json: every answer, and the differences.
	r := runCLI(t, slices.Concat([]string{"models"}, flags, []string{"--check", "--json", "--lookup-url", url("lookup-other")})...)
	var got modelsCheck
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || r.code != 1 {
		t.Fatalf("check --json: exit %d, stdout not a check (%v)", r.code, err)
	}
	if got.Same || len(got.Differences) != 2 || len(got.Services) != 3 || len(got.Errors) != 0 {
		t.Errorf("check --json: same %v, %d differences, %d answers, errors %v; want 2 differences in 3 answers",
			got.Same, len(got.Differences), len(got.Services), got.Errors)
	}
	if a := got.Services["sender"]; a == nil || len(a.Items) != 3 {
		t.Errorf("check --json: the sender's answer %+v, want its 3 models", a)
	}
}

// TestModelDifferences checks what --check names: a model some services
// serve and others not, another fingerprint, another default, and nothing
// for answers that agree (in any order of the non-default models) or for a
// service that could not be asked.
func TestModelDifferences(t *testing.T) {
	model := func(name, fp string, def bool) adminapi.ServedModel {
		return adminapi.ServedModel{Name: name, Fingerprint: fp, Default: def}
	}
	served := func(ms ...adminapi.ServedModel) *adminapi.ServedModels { return &adminapi.ServedModels{Items: ms} }
	base := served(model("a", "f1", true), model("b", "f2", false), model("c", "f3", false))
	tests := []struct {
		name    string
		answers []*adminapi.ServedModels // lookup, scheduler, sender
		want    []string
	}{
		{"the same", []*adminapi.ServedModels{base, base, base}, nil},
		{"the same in another order",
			[]*adminapi.ServedModels{base, served(model("a", "f1", true), model("c", "f3", false), model("b", "f2", false)), base}, nil},
		{"one service not asked", []*adminapi.ServedModels{base, nil, base}, nil},
		{"a model the sender lacks",
			[]*adminapi.ServedModels{base, base, served(model("a", "f1", true), model("b", "f2", false))},
			[]string{`model "c": served by lookup and scheduler, not by sender`}},
		{"a model only the scheduler serves",
			[]*adminapi.ServedModels{base, served(model("a", "f1", true), model("b", "f2", false), model("c", "f3", false), model("d", "f4", false)), base},
			[]string{`model "d": served by scheduler, not by lookup and sender`}},
		{"another fingerprint",
			[]*adminapi.ServedModels{served(model("a", "f1", true), model("b", "f9", false), model("c", "f3", false)), base, base},
			[]string{`model "b": fingerprint f9 on lookup, f2 on scheduler and sender`}},
		{"three fingerprints",
			[]*adminapi.ServedModels{base, served(model("a", "f7", true), model("b", "f2", false), model("c", "f3", false)),
				served(model("a", "f8", true), model("b", "f2", false), model("c", "f3", false))},
			[]string{`model "a": fingerprint f1 on lookup, f7 on scheduler, f8 on sender`}},
		{"another default",
			[]*adminapi.ServedModels{base, base, served(model("b", "f2", true), model("a", "f1", false), model("c", "f3", false))},
			[]string{`default model (KVMESH_MODEL): "a" on lookup and scheduler, "b" on sender`}},
		{"missing and another fingerprint",
			[]*adminapi.ServedModels{served(model("a", "f1", true)), base, served(model("a", "f1", true), model("b", "f0", false))},
			[]string{
				`model "b": served by scheduler and sender, not by lookup`,
				`model "b": fingerprint f2 on scheduler, f0 on sender`,
				`model "c": served by scheduler, not by lookup and sender`,
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := modelDifferences(modelsServices, tt.answers)
			if !slices.Equal(got, tt.want) {
				t.Errorf("differences\n%q\nwant\n%q", got, tt.want)
			}
		})
	}
}

// TestModelsSummaries checks the PARALLEL and GROUPS cells of the table.
func TestModelsSummaries(t *testing.T) {
	tests := []struct {
		preset       string
		tp, pcp, dcp int
		parallel     string
		groups       string
	}{
		{preset: "dense", parallel: "tp1", groups: "full_attention/16"},
		{preset: "hybrid-mla-linear-tp8", parallel: "tp8", groups: "mla/16,mamba/16"},
		{preset: "full-swa-mamba", parallel: "tp1", groups: "full_attention/16,sliding_window/32:w128,mamba/16"},
		{preset: "hybrid-mla-linear-partial", parallel: "tp1", groups: "mla/64,mamba/64"},
		{preset: "dense", tp: 4, dcp: 2, parallel: "tp4,dcp2", groups: "full_attention/16"},
	}
	for _, tt := range tests {
		m, err := service.LoadModel(tt.preset)
		if err != nil {
			t.Fatal(err)
		}
		if err := (service.ParallelOverride{TP: tt.tp, PCP: tt.pcp, DCP: tt.dcp}).Apply(m); err != nil {
			t.Fatalf("%s: %v", tt.preset, err)
		}
		if got := parallelSummary(m); got != tt.parallel {
			t.Errorf("%s tp%d dcp%d: parallel %q, want %q", tt.preset, tt.tp, tt.dcp, got, tt.parallel)
		}
		if got := groupsSummary(m); got != tt.groups {
			t.Errorf("%s: groups %q, want %q", tt.preset, got, tt.groups)
		}
	}
	if parallelSummary(nil) != "-" || groupsSummary(nil) != "-" {
		t.Error("a model without a spec: want - in both cells")
	}
}

// TestModelsUsageErrors checks the command lines kvmesh models refuses
// before asking a service: exit 2 with the reason.
func TestModelsUsageErrors(t *testing.T) {
	flags := []string{"--lookup-url", "http://127.0.0.1:1", "--token", "t"}
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"models", "dense"}, "models takes no arguments"},
		{[]string{"models", "--service", "gpuworker"}, `--service "gpuworker" is not lookup, scheduler or sender`},
		{[]string{"models", "--nope"}, "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := runCLI(t, slices.Concat(tt.args, flags)...)
			if r.code != 2 || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("exit %d, stderr %q; want exit 2 saying %q", r.code, r.stderr, tt.want)
			}
		})
	}
}
