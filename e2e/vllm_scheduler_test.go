package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// The vLLM source pack the vLLM-scheduler tests run vLLM from.
const (
	// vllmPackEnv names the pack's directory (its setup.sh and vLLM
	// trees); without it, ../shared/vllm beside the checkout when present.
	vllmPackEnv = "KVMESH_VLLM_PACK"
	// vllmRequireEnv set to 1 fails the tests instead of skipping them
	// when the pack is missing (.ci/run sets it).
	vllmRequireEnv = "KVMESH_REQUIRE_VLLM"
	// vllmSuiteDir holds the pytest tests that put vLLM's scheduler in charge.
	vllmSuiteDir = "connectors/vllm/tests/vllm"
	// vllmSuiteTimeout bounds one tree's pytest run against one stack.
	vllmSuiteTimeout = 6 * time.Minute
	// vllmPytestArgsEnv adds arguments to each pytest run (e.g. "-k
	// async" to run some scenarios only, while debugging).
	vllmPytestArgsEnv = "KVMESH_VLLM_PYTEST_ARGS"
)

// vllmTrees are the upstream vLLM trees of the pack the suite runs on.
var vllmTrees = []string{vllmOldest, vllmNewest}

// The oldest and the newest tree of the pack.
const (
	vllmOldest = "vllm-2026-05-27-52a31cc"
	vllmNewest = "vllm-2026-08-22-7f4a1b7"
)

// vllmModels are the mesh models the suite plays, each on its own stack,
// with the scenarios each plays on each tree (a pytest -k expression; ""
// for all). Every model plays kvmesh alone, load errors under both
// policies and MultiConnector. The traced request, preemption, aborts and
// outages (the Kafka outage takes the whole mesh's broker away) exercise
// the same connector paths on every layout, so each tree plays them on
// one model whose loads hit: on the newest tree the MLA + linear model
// (the smallest blocks; the dense model's 2 MiB blocks made the same
// scenarios four times as long under the race detector, 80 s against
// 20 s), on the oldest the dense one (that tree loads nothing external
// for a Mamba model, so there the MLA + linear model plays the basic
// scenarios only). This keeps make test within its time.
var vllmModels = []struct {
	name string
	only map[string]string // by tree; a tree not named plays every scenario
}{
	{"dense", map[string]string{vllmNewest: basicScenarios}},
	{model, map[string]string{vllmOldest: basicScenarios}},
	{"full-swa-mamba", map[string]string{vllmOldest: basicScenarios, vllmNewest: basicScenarios}},
}

// basicScenarios are the scenarios every model plays.
const basicScenarios = "alone or load_errors or multiconnector"

// TestVLLMScheduler runs connectors/vllm/tests/vllm — vLLM's own v1
// Scheduler, KVCacheManager, KVConnectorFactory, MultiConnector and
// model-runner connector code, from each tree of the vLLM source pack,
// driving kvmesh_vllm against a running mesh with authentication on — for
// each model of vllmModels. The pytest suite plays the model runner only.
// Without the pack the test is skipped with one line saying why, unless
// KVMESH_REQUIRE_VLLM=1.
func TestVLLMScheduler(t *testing.T) {
	testenv.RequirePython(t, pythonModules...)
	pack := vllmPack(t)
	root := testenv.ModuleRoot(t)
	envs := map[string][]string{}
	for _, tree := range vllmTrees {
		envs[tree] = vllmEnv(t, pack, tree)
	}
	report := os.Getenv("KVMESH_CONNECTOR_REPORT")
	for i, vm := range vllmModels {
		m := vm.name
		args := strings.Fields(os.Getenv(vllmPytestArgsEnv))
		if i > 0 { // the plugin test needs no mesh: once per tree is enough
			args = append(args, "--ignore="+filepath.Join(root, vllmSuiteDir, "test_plugin.py"))
		}
		t.Run(m, func(t *testing.T) {
			s := newStack(t, stackOptions{model: m, connectors: "pd,store", poolBlocks: 128, durableBroker: true})
			dir := t.TempDir()
			desc := meshDescription(t, s)
			desc.ControlURL = brokerControl(t, s)
			meshPath := writeJSON(t, dir, "mesh.json", desc)
			for _, tree := range vllmTrees {
				t.Run(tree, func(t *testing.T) {
					args := args
					if only := vm.only[tree]; only != "" {
						args = append(slices.Clip(args), "-k", only)
					}
					ctx, cancel := context.WithTimeout(context.Background(), vllmSuiteTimeout)
					defer cancel()
					rep := filepath.Join(dir, tree+"-report.txt")
					env := append(append([]string{}, envs[tree]...),
						"KVMESH_MESH_FILE="+meshPath,
						"KVMESH_REQUIRE_MESH=1",
						"KVMESH_VLLM_TREE="+tree,
						"KVMESH_VLLM_REPORT="+rep,
					)
					err := runPytest(ctx, t, root, filepath.Join(root, vllmSuiteDir), vllmSuiteTimeout, env, args...)
					if b, rerr := os.ReadFile(rep); rerr == nil {
						t.Logf("scenario report, %s on %s:\n%s", m, tree, b)
						if report != "" {
							appendReport(t, report, fmt.Sprintf("TestVLLMScheduler %s %s\n%s\n", m, tree, b))
						}
					}
					if err != nil {
						t.Fatalf("vLLM's scheduler (%s) driving kvmesh_vllm on %s: %v", tree, m, err)
					}
				})
			}
		})
	}
}

// vllmPack is the pack's directory, or skips (fails under
// KVMESH_REQUIRE_VLLM=1) when there is none.
func vllmPack(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(vllmPackEnv)
	if dir == "" {
		dir = filepath.Join(testenv.ModuleRoot(t), "..", "shared", "vllm")
	}
	if _, err := os.Stat(filepath.Join(dir, "setup.sh")); err != nil {
		msg := fmt.Sprintf("no vLLM source pack at %s (%s names it): vLLM's scheduler tests need it", dir, vllmPackEnv)
		if os.Getenv(vllmRequireEnv) == "1" {
			t.Fatal(msg + " (" + vllmRequireEnv + "=1)")
		}
		t.Skip(msg)
	}
	return dir
}

// brokerControl serves the Kafka-outage scenario's switch for the stack's
// (durable) broker on a local address, until the test ends: POST
// /broker/stop takes the broker away, POST /broker/start brings it back on
// the same address with what it persisted. It returns the base URL.
func brokerControl(t *testing.T, s *stack) string {
	t.Helper()
	var mu sync.Mutex // StopBroker and StartBroker must not run concurrently
	mux := http.NewServeMux()
	mux.HandleFunc("POST /broker/stop", func(http.ResponseWriter, *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		s.mesh.StopBroker()
		t.Log("broker stopped by the vLLM suite")
	})
	mux.HandleFunc("POST /broker/start", func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if err := s.mesh.StartBroker(); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		t.Log("broker started by the vLLM suite")
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(func() {
		srv.Close()
		mu.Lock()
		defer mu.Unlock()
		if err := s.mesh.StartBroker(); err != nil { // a failed scenario must not leave the stack without one
			t.Errorf("restarting the broker: %v", err)
		}
	})
	return srv.URL
}

// vllmEnv runs the pack's setup.sh for tree (it installs Debian packages
// when missing and links pydantic 2) and returns the variables it exports.
func vllmEnv(t *testing.T, pack, tree string) []string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("bash", filepath.Join(pack, "setup.sh"), tree)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s/setup.sh %s: %v\n%s", pack, tree, err, stderr.String())
	}
	var env []string
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		line, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "export ")
		if !ok {
			continue // apt's progress lines, comments
		}
		for _, kv := range strings.Fields(line) {
			k, v, _ := strings.Cut(kv, "=")
			env = append(env, k+"="+os.Expand(strings.ReplaceAll(v, `\$`, "$"), func(string) string { return "" }))
		}
	}
	if len(env) == 0 {
		t.Fatalf("%s/setup.sh %s exported nothing:\n%s", pack, tree, stdout.String())
	}
	return env
}
