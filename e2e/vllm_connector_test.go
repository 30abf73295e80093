package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// The Python side of TestVLLMConnector.
const (
	// defaultHarnessDir is the connector's mesh tests, from the repository
	// root; KVMESH_HARNESS_DIR overrides it.
	defaultHarnessDir = "connectors/vllm/tests/mesh"
	// harnessTimeout bounds the pytest run.
	harnessTimeout = 3 * time.Minute
	// connectorRequests is the size of the workload both engines play.
	connectorRequests = 12
)

// pythonModules are the modules the harness imports and the Debian
// packages that provide them.
var pythonModules = []testenv.PythonModule{
	{Module: "confluent_kafka", Package: "python3-confluent-kafka"}, testenv.Numpy,
	{Module: "torch", Package: "python3-torch"}, {Module: "pytest", Package: "python3-pytest"},
}

// TestVLLMConnector plays one workload through the Python vLLM connector
// (kvmesh_vllm, driven by its mesh tests in connectors/vllm/tests/mesh)
// and through the Go simulator on the same stack — the 2-group hybrid
// model, 1P1D with the pd,store chain, a small pool, authentication on —
// and prints both reports side by side. The harness must exit 0 and
// report no failed request, no mismatched block, a balanced save ledger
// and no save of a connector the multi-connector rejected; the simulator
// must be clean.
//
// Without Debian's python3-confluent-kafka, -numpy, -torch and -pytest
// the test is skipped (it fails under KVMESH_REQUIRE_PYTHON=1, as `make
// test` runs it). KVMESH_HARNESS_DIR replaces the harness directory;
// KVMESH_CONNECTOR_REPORT names a file for the side-by-side table.
func TestVLLMConnector(t *testing.T) {
	playConnector(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64}, connectorRequests)
}

// TestVLLMConnectorTP8 plays the harness's store runs (kvmesh alone, and
// as MultiConnector's store child) at the seed's shape: the MLA +
// linear-attention model at TP8, one connector worker and one gpuworker
// per rank, each rank's blocks written, recorded and checked in its own
// KV memory.
func TestVLLMConnectorTP8(t *testing.T) {
	playConnector(t, stackOptions{model: tp8Model, connectors: "pd,store", poolBlocks: 64}, connectorRequests/2,
		"-k", "kvmesh_alone or multiconnector")
}

// playConnector starts a stack of o, plays requests of the small workload
// through the harness (pytest args narrow it), then through the Go
// simulator — cold and replayed on a restarted engine — and compares.
func playConnector(t *testing.T, o stackOptions, requests int, pytestArgs ...string) {
	testenv.RequirePython(t, pythonModules...)
	root := testenv.ModuleRoot(t)
	harness := harnessDir(t, root)
	s := newStack(t, o)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	w := smallWorkload(requests, 4)
	tag := "py" + strings.TrimPrefix(sim.NewRunTag(), "sim")
	env := []string{
		"KVMESH_MESH_FILE=" + writeJSON(t, dir, "mesh.json", meshDescription(t, s)),
		"KVMESH_WORKLOAD_FILE=" + writeJSON(t, dir, "workload.json", workloadPlan(t, w, tag)),
		"KVMESH_HARNESS_REPORT=" + filepath.Join(dir, "harness-report.json"),
		"KVMESH_REQUIRE_MESH=1",
	}
	if err := runHarness(ctx, t, root, harness, env, pytestArgs...); err != nil {
		logFile(t, filepath.Join(dir, "harness-report.json"))
		t.Fatalf("the Python harness %s: %v", harness, err)
	}
	h := readHarnessReport(t, filepath.Join(dir, "harness-report.json"))
	// The simulator plays the harness's part: the decode engine alone, on
	// its own pd,store chain, with no prefill engine handing it prompts.
	cold := decodeConfig(t, s, w)
	rep, err := sim.Run(ctx, cold)
	if err != nil {
		t.Fatal(err)
	}
	// Then both replay the workload on a restarted engine (empty KV memory
	// and prefix cache) with the first run's salt: the prompts hash to the
	// keys the first run saved, so they load from the store.
	again := decodeConfig(t, s, w)
	again.Salt = cold.Salt
	replay, err := sim.Run(ctx, again)
	if err != nil {
		t.Fatal(err)
	}
	hReplay, _ := h["replay"].(map[string]any)
	table := comparisonTable(column{"connector", harnessColumn(h)}, column{"Go sim", simColumn(rep)},
		column{"connector replay", harnessColumn(harnessReport(hReplay))}, column{"Go sim replay", simColumn(replay)})
	t.Logf("the vLLM connector's harness (run %s) and the Go simulator (run %s), %s at %d worker ranks:\n%s", tag, rep.RunTag, o.model, len(s.ranks), table)
	if path := os.Getenv("KVMESH_CONNECTOR_REPORT"); path != "" {
		appendReport(t, path, fmt.Sprintf("%s (%s, %d worker ranks per engine)\n%s\n", t.Name(), o.model, len(s.ranks), table))
	}
	checkHarnessReport(t, h)
	requireOK(t, rep)
	requireOK(t, replay)
	if replay.Tokens.Loaded["store"] == 0 {
		t.Errorf("the simulator's replay loaded nothing from the store: %v", replay.Tokens.Loaded)
	}
}

// decodeConfig is the simulator on the stack's decode engine, every rank.
func decodeConfig(t *testing.T, s *stack, w sim.Workload) sim.Config {
	t.Helper()
	cfg := simConfig(t, s, false, w)
	if len(s.ranks) > 1 {
		cfg.Model = parallelModel(t, s)
		cfg.Decode = sim.Endpoint{WorkerURLs: s.workerURLs("gpuworker")}
		cfg.Prefill = sim.Endpoint{WorkerURLs: s.workerURLs("gpuworker-prefill")}
	}
	return cfg
}

// appendReport adds text to the file at path.
func appendReport(t *testing.T, path, text string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err == nil {
		_, err = f.WriteString(text)
		err = errors.Join(err, f.Close())
	}
	if err != nil {
		t.Errorf("KVMESH_CONNECTOR_REPORT: %v", err)
	}
}

// harnessDir is the directory of the harness's tests: KVMESH_HARNESS_DIR,
// else defaultHarnessDir, relative to root unless absolute. The test fails
// when it is missing or holds no test file.
func harnessDir(t *testing.T, root string) string {
	t.Helper()
	dir := os.Getenv("KVMESH_HARNESS_DIR")
	if dir == "" {
		dir = defaultHarnessDir
	}
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(root, dir) // pytest runs from the root
	}
	const what = "it holds the pytest tests (test_*.py) that play workload.json through kvmesh_vllm; KVMESH_HARNESS_DIR runs another"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		t.Fatalf("the vLLM connector's mesh harness is missing: %s is not a directory (%v); %s", dir, err, what)
	}
	n, err := countTestFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatalf("the vLLM connector's mesh harness is missing: no test_*.py under %s; %s", dir, what)
	}
	return dir
}

// countTestFiles counts the files pytest collects by default under dir:
// test_*.py and *_test.py.
func countTestFiles(dir string) (int, error) {
	n := 0
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if !d.IsDir() && strings.HasSuffix(name, ".py") && (strings.HasPrefix(name, "test_") || strings.HasSuffix(name, "_test.py")) {
			n++
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("walk %s: %w", dir, err)
	}
	return n, nil
}

// meshFile is mesh.json: everything the harness needs to reach the stack.
type meshFile struct {
	Model       *kvcore.Model `json:"model"`
	Fingerprint string        `json:"fingerprint"`
	LookupURL   string        `json:"lookup_url"`
	Scheduler   string        `json:"scheduler_url"`
	SenderURL   string        `json:"sender_url"`
	Kafka       kafkaFile     `json:"kafka"`
	AdminToken  string        `json:"admin_token"`
	RedisURL    string        `json:"redis_url"`
	KeyPrefix   string        `json:"key_prefix"`
	Engines     []engineFile  `json:"engines"`
	// ControlURL, when set, is the test's broker control (brokerControl):
	// POST /broker/stop and /broker/start take the Kafka broker away and
	// bring it back.
	ControlURL string `json:"control_url,omitempty"`
}

// kafkaFile is how the harness reaches the broker.
type kafkaFile struct {
	// Bootstrap is the comma-separated host:port list.
	Bootstrap string `json:"bootstrap"`
}

// engineFile is one engine of the stack with its gpuworkers.
type engineFile struct {
	EngineID   string          `json:"engine_id"`
	Role       string          `json:"role"`
	Token      string          `json:"token"`
	GPUWorkers []gpuWorkerFile `json:"gpuworkers"`
}

// gpuWorkerFile is one rank's gpuworker.
type gpuWorkerFile struct {
	Rank kvcore.Rank `json:"rank"`
	URL  string      `json:"url"`
}

// meshDescription describes s for the harness: the model as `kvmesh model
// --json` prints it, the services, the broker, the store and the decode
// and prefill engines with an engine token each.
func meshDescription(t *testing.T, s *stack) meshFile {
	t.Helper()
	m, err := service.LoadModel(s.model)
	if err != nil {
		t.Fatal(err)
	}
	engine := func(id, role, base string) engineFile {
		e := engineFile{EngineID: id, Role: role, Token: s.mesh.EngineToken(t, id)}
		for k, url := range s.workerURLs(base) {
			e.GPUWorkers = append(e.GPUWorkers, gpuWorkerFile{Rank: s.ranks[k], URL: url})
		}
		return e
	}
	return meshFile{
		Model: m, Fingerprint: m.Fingerprint(),
		LookupURL: s.url("lookup"), Scheduler: s.url("scheduler"), SenderURL: s.url("sender"),
		Kafka:      kafkaFile{Bootstrap: strings.Join(s.brokers, ",")},
		AdminToken: adminToken, RedisURL: s.redisURL, KeyPrefix: s.prefix,
		Engines: []engineFile{engine(decodeEngine, "decode", "gpuworker"), engine(prefillEngine, "prefill", "gpuworker-prefill")},
	}
}

// workloadPlan is w as the simulator plays it in the run tagged tag,
// salted with the tag (as simConfig salts a run).
func workloadPlan(t *testing.T, w sim.Workload, tag string) sim.WorkloadPlan {
	t.Helper()
	m, err := kvcore.Preset(model)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := sim.PlanWorkload(w, tag)
	if err != nil {
		t.Fatal(err)
	}
	plan.Salt, plan.HashBlockSize = tag, m.HashBlockSize
	return plan
}

// writeJSON writes v as dir/name and returns the path.
func writeJSON(t *testing.T, dir, name string, v any) string {
	t.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// runHarness runs pytest on the harness directory (runPytest, bounded
// by harnessTimeout).
func runHarness(ctx context.Context, t *testing.T, root, harness string, env []string, args ...string) error {
	t.Helper()
	return runPytest(ctx, t, root, harness, harnessTimeout, env, args...)
}

// runPytest runs pytest on dir from the repository root, with the
// connector's package first on PYTHONPATH (before any PYTHONPATH env
// names) and env added, streaming its output into the test log; it fails
// when pytest exits non-zero or outlives timeout (its whole process group
// is killed then).
func runPytest(ctx context.Context, t *testing.T, root, dir string, timeout time.Duration, env []string, args ...string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.PythonBin, append([]string{"-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", dir}, args...)...)
	cmd.Dir = root
	path := filepath.Join(root, "connectors", "vllm")
	var rest []string
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PYTHONPATH="); ok {
			path += ":" + v
			continue
		}
		rest = append(rest, kv)
	}
	cmd.Env = append(os.Environ(), append([]string{
		"PYTHONPATH=" + path,
		"PYTHONDONTWRITEBYTECODE=1", // no __pycache__ in the checkout
		"PYTHONUNBUFFERED=1",
	}, rest...)...)
	log := &lineLogger{t: t, prefix: "pytest: "}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
	log.flush()
	if ctx.Err() != nil {
		return fmt.Errorf("pytest ran past %v: %w", timeout, ctx.Err())
	}
	if err != nil {
		return fmt.Errorf("pytest: %w", err)
	}
	return nil
}

// lineLogger writes what it is given to the test log, a line at a time.
type lineLogger struct {
	t      *testing.T
	prefix string
	mu     sync.Mutex
	buf    []byte
}

// Write logs every complete line of p and keeps the rest.
func (l *lineLogger) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		l.t.Log(l.prefix + string(l.buf[:i]))
		l.buf = l.buf[i+1:]
	}
}

// flush logs a last line without a newline.
func (l *lineLogger) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.buf) > 0 {
		l.t.Log(l.prefix + string(l.buf))
		l.buf = nil
	}
}

// logFile logs the file at path, if there is one.
func logFile(t *testing.T, path string) {
	t.Helper()
	if b, err := os.ReadFile(path); err == nil {
		t.Logf("%s:\n%s", filepath.Base(path), b)
	}
}

// harnessReport is the JSON object the harness writes: any fields, of
// which the test reads those of harnessRequired and a few more.
type harnessReport map[string]any

// harnessRequired are the fields the test asserts on; a report without
// one fails.
var harnessRequired = []string{"requests_total", "requests_failed", "blocks_mismatched", "ledger_balanced", "multiconnector_saves_from_rejected"}

// readHarnessReport reads the harness report at path.
func readHarnessReport(t *testing.T, path string) harnessReport {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the harness wrote no report: %v", err)
	}
	var h harnessReport
	if err := json.Unmarshal(b, &h); err != nil {
		t.Fatalf("harness report %s: %v", path, err)
	}
	t.Logf("harness report:\n%s", b)
	return h
}

// num is field key as a number; ok is false when it is missing or not a
// number.
func (h harnessReport) num(key string) (float64, bool) {
	v, ok := h[key].(float64)
	return v, ok
}

// text is field key as the harness wrote it, "-" when missing.
func (h harnessReport) text(key string) string {
	if v, ok := h[key]; ok {
		return fmt.Sprint(v)
	}
	return "-"
}

// sub is field key's entry name as a number (a map of counts, e.g.
// tokens_loaded or saves); ok is false when it is missing.
func (h harnessReport) sub(key string, names ...string) (float64, bool) {
	m, _ := h[key].(map[string]any)
	for _, name := range names {
		if v, ok := m[name].(float64); ok {
			return v, true
		}
	}
	return 0, false
}

// checkHarnessReport fails the test with every problem of the harness
// report (harnessProblems).
func checkHarnessReport(t *testing.T, h harnessReport) {
	t.Helper()
	for _, p := range harnessProblems(h) {
		t.Error("harness report: " + p)
	}
}

// harnessProblems lists what is wrong with a harness report: a required
// field missing, no request played, a failed request, a mismatched block,
// a save from a connector the multi-connector rejected, an unbalanced
// ledger.
func harnessProblems(h harnessReport) []string {
	var out []string
	for _, key := range harnessRequired {
		if _, ok := h[key]; !ok {
			out = append(out, fmt.Sprintf("no %q", key))
		}
	}
	if n, _ := h.num("requests_total"); n <= 0 {
		out = append(out, fmt.Sprintf("no request played (requests_total %v)", h["requests_total"]))
	}
	for _, key := range []string{"requests_failed", "blocks_mismatched", "multiconnector_saves_from_rejected"} {
		if n, ok := h.num(key); !ok || n != 0 {
			out = append(out, fmt.Sprintf("%s = %v, want 0", key, h[key]))
		}
	}
	if b, _ := h["ledger_balanced"].(bool); !b {
		out = append(out, fmt.Sprintf("ledger_balanced = %v, want true", h["ledger_balanced"]))
	}
	return out
}

// comparisonRows names the rows of comparisonTable, in order.
var comparisonRows = []string{
	"requests ok/total", "hit rate", "tokens local", "tokens loaded store", "tokens loaded pd", "preemptions",
	"blocks checked", "blocks mismatched", "ledger balanced", "saves stored", "saves existing", "saves dead-lettered",
}

// harnessColumn is a harness report's figures in comparisonRows' order;
// "-" marks a figure the harness did not report.
func harnessColumn(h harnessReport) []string {
	cell := func(v float64, ok bool) string {
		if !ok {
			return "-"
		}
		return fmt.Sprintf("%.0f", v)
	}
	rate := "-"
	if v, ok := h.num("hit_rate"); ok {
		rate = fmt.Sprintf("%.1f%%", 100*v)
	}
	return []string{
		cell(h.num("requests_ok")) + "/" + cell(h.num("requests_total")), rate, cell(h.num("tokens_local")),
		cell(h.sub("tokens_loaded", "store")), cell(h.sub("tokens_loaded", "pd")), cell(h.num("preemptions")),
		cell(h.num("blocks_checked")), cell(h.num("blocks_mismatched")), h.text("ledger_balanced"),
		cell(h.sub("saves", "stored")), cell(h.sub("saves", "existing")), cell(h.sub("saves", "dead_lettered", "dead-lettered")),
	}
}

// simColumn is a simulator report's figures in comparisonRows' order.
// Saves are the simulator's ledger in store keys.
func simColumn(rep *sim.Report) []string {
	return []string{
		fmt.Sprintf("%d/%d", rep.Requests.OK, rep.Requests.Total), fmt.Sprintf("%.1f%%", 100*rep.PrefixHitRate),
		fmt.Sprint(rep.Tokens.LocalHit), fmt.Sprint(rep.Tokens.Loaded["store"]), fmt.Sprint(rep.Tokens.Loaded["pd"]),
		fmt.Sprint(rep.Preemptions), fmt.Sprint(rep.Verification.VerifiedBlocks), fmt.Sprint(rep.Verification.Mismatched),
		fmt.Sprint(rep.Ledger.Balanced), fmt.Sprint(rep.Ledger.Stored), fmt.Sprint(rep.Ledger.Existing), fmt.Sprint(rep.Ledger.DeadLettered),
	}
}

// column is one run's figures under a heading.
type column struct {
	name  string
	cells []string
}

// comparisonTable lays columns side by side, a row per figure.
func comparisonTable(cols ...column) string {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, c := range cols {
		fmt.Fprint(tw, "\t"+c.name)
	}
	fmt.Fprintln(tw)
	for i, row := range comparisonRows {
		fmt.Fprint(tw, row)
		for _, c := range cols {
			fmt.Fprint(tw, "\t"+c.cells[i])
		}
		fmt.Fprintln(tw)
	}
	_ = tw.Flush() // a strings.Builder does not fail
	return b.String()
}

// TestHarnessProblems: a clean harness report passes; each fault, and a
// missing field, is named.
func TestHarnessProblems(t *testing.T) {
	clean := func() harnessReport {
		return harnessReport{"requests_total": 12.0, "requests_ok": 12.0, "requests_failed": 0.0, "blocks_mismatched": 0.0,
			"ledger_balanced": true, "multiconnector_saves_from_rejected": 0.0}
	}
	for _, tc := range []struct {
		name   string
		mutate func(harnessReport)
		want   []string // one substring per problem, in order
	}{
		{"clean", func(harnessReport) {}, nil},
		{"failed request", func(h harnessReport) { h["requests_failed"] = 1.0 }, []string{"requests_failed = 1"}},
		{"mismatch", func(h harnessReport) { h["blocks_mismatched"] = 2.0 }, []string{"blocks_mismatched = 2"}},
		{"unbalanced", func(h harnessReport) { h["ledger_balanced"] = false }, []string{"ledger_balanced = false"}},
		{"rejected saves", func(h harnessReport) { h["multiconnector_saves_from_rejected"] = 3.0 }, []string{"multiconnector_saves_from_rejected = 3"}},
		{"nothing played", func(h harnessReport) { h["requests_total"] = 0.0 }, []string{"no request played"}},
		{"missing ledger", func(h harnessReport) { delete(h, "ledger_balanced") }, []string{`no "ledger_balanced"`, "ledger_balanced = <nil>"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := clean()
			tc.mutate(h)
			got := harnessProblems(h)
			if len(got) != len(tc.want) {
				t.Fatalf("problems %q; want %q", got, tc.want)
			}
			for i, w := range tc.want {
				if !strings.Contains(got[i], w) {
					t.Fatalf("problems %q; want %q", got, tc.want)
				}
			}
		})
	}
}

// TestComparisonTable: every row is there, with "-" for what the harness
// did not report.
func TestComparisonTable(t *testing.T) {
	rep := &sim.Report{Requests: sim.RequestCounts{Total: 12, OK: 12}, PrefixHitRate: 0.5,
		Tokens: sim.TokenCounts{Loaded: map[string]int{"pd": 64}}}
	h := harnessReport{"requests_total": 12.0, "requests_ok": 11.0, "hit_rate": 0.25, "saves": map[string]any{"dead_lettered": 2.0}}
	table := comparisonTable(column{"connector", harnessColumn(h)}, column{"Go sim", simColumn(rep)})
	for _, want := range []string{"requests ok/total    11/12", "hit rate             25.0%", "50.0%", "tokens loaded pd     -", "64", "saves dead-lettered  2", "ledger balanced      -"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	if n := strings.Count(table, "\n"); n != len(comparisonRows)+1 {
		t.Errorf("%d lines, want a heading and %d rows:\n%s", n, len(comparisonRows), table)
	}
}
