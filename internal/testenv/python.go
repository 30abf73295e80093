package testenv

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// PythonBin is Debian's interpreter: the one that sees Debian's python3-*
// packages, which the vLLM connector's tests use (a pyenv or virtualenv
// python3 on PATH does not).
const PythonBin = "/usr/bin/python3"

// PythonModule is a module a test imports and the Debian package that
// provides it.
type PythonModule struct {
	// Module is the import name.
	Module string
	// Package is the Debian package.
	Package string
}

// Numpy is the module the connector's interop scripts need.
var Numpy = PythonModule{"numpy", "python3-numpy"}

// RequirePython skips t unless PythonBin imports every module, naming
// the apt-get command that installs them; under KVMESH_REQUIRE_PYTHON=1
// (as `make test` runs) it fails instead.
func RequirePython(t testing.TB, modules ...PythonModule) {
	t.Helper()
	var imports, pkgs []string
	for _, m := range modules {
		imports, pkgs = append(imports, m.Module), append(pkgs, m.Package)
	}
	out, err := exec.Command(PythonBin, "-c", "import "+strings.Join(imports, ", ")).CombinedOutput()
	if err == nil {
		return
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	msg := fmt.Sprintf("%s cannot import %s (%v: %s); install them with: sudo apt-get install -y --no-install-recommends %s",
		PythonBin, strings.Join(imports, ", "), err, strings.TrimSpace(lines[len(lines)-1]), strings.Join(pkgs, " "))
	if os.Getenv("KVMESH_REQUIRE_PYTHON") == "1" {
		t.Fatal(msg + " (KVMESH_REQUIRE_PYTHON=1)")
	}
	t.Skip(msg)
}

// ConnectorDir is the vLLM connector's directory, connectors/vllm: the
// root of its package and tests.
func ConnectorDir(t testing.TB) string {
	t.Helper()
	return filepath.Join(ModuleRoot(t), "connectors", "vllm")
}

// PythonCommand is PythonBin running args with the connector's package on
// PYTHONPATH (after RequirePython of numpy).
func PythonCommand(t testing.TB, args ...string) *exec.Cmd {
	t.Helper()
	RequirePython(t, Numpy)
	cmd := exec.Command(PythonBin, args...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+ConnectorDir(t), "PYTHONDONTWRITEBYTECODE=1")
	return cmd
}

// RunInterop runs one of the connector's interop scripts
// (connectors/vllm/tests/interop/NAME) with args, the JSON of in on its
// stdin, and decodes the JSON it prints into out.
func RunInterop(t testing.TB, name string, in, out any, args ...string) {
	t.Helper()
	body, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	cmd := PythonCommand(t, append([]string{filepath.Join(ConnectorDir(t), "tests", "interop", name)}, args...)...)
	cmd.Stdin = bytes.NewReader(body)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
	}
	if err := json.Unmarshal(stdout.Bytes(), out); err != nil {
		t.Fatalf("decode %s's answer: %v\n%s", name, err, stdout.String())
	}
}
