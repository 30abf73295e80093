package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// binDirPrefix names the per-process directory BuildBinary builds into:
// os.TempDir()/kvmesh-testbin-<pid>.
const binDirPrefix = "kvmesh-testbin-"

// binDirEnv names a directory of prebuilt binaries (see goBuild).
const binDirEnv = "KVMESH_TEST_BIN_DIR"

// cgoCFlags silences go-nvml's C warnings; it applies only
// when the environment sets no CGO_CFLAGS of its own.
const cgoCFlags = "-O2 -g -Wno-deprecated-declarations"

// builds holds the binaries of this test process, one build per package.
var builds struct {
	mu   sync.Mutex
	dir  string
	bins map[string]*build
}

// build is one package's binary, built once.
type build struct {
	pkg  string // as ./dir/name
	once sync.Once
	path string
	err  error
}

// BuildBinary builds the main package pkg, a path relative to the module
// root such as "./services/sender", and returns the binary's path. The
// binary is built without -race (-ldflags=-s -w) once per test process:
// later calls, from any test, get the same file, which lives in
// os.TempDir()/kvmesh-testbin-<pid> rather than a test's TempDir because it
// outlives the test that built it. Directories left by earlier test
// processes that have exited are removed when the directory is made;
// RemoveBinaries removes this process's. A failed build fails the calling
// test and every later caller for the same package.
func BuildBinary(t testing.TB, pkg string) string {
	t.Helper()
	return BuildBinaries(t, pkg)[0]
}

// BuildBinaries is BuildBinary for several packages at once, built
// concurrently; it returns their paths in the order of pkgs.
func BuildBinaries(t testing.TB, pkgs ...string) []string {
	t.Helper()
	bs := make([]*build, len(pkgs))
	for i, pkg := range pkgs {
		if !strings.HasPrefix(pkg, "./") {
			t.Fatalf("BuildBinary(%q): want a path relative to the module root, like ./services/sender", pkg)
		}
		bs[i] = buildOf("./" + path.Clean(pkg))
	}
	var wg sync.WaitGroup
	for _, b := range bs {
		wg.Go(func() { b.once.Do(func() { b.path, b.err = goBuild(b.pkg) }) })
	}
	wg.Wait()
	paths := make([]string, len(bs))
	errs := make([]error, len(bs))
	for i, b := range bs {
		paths[i], errs[i] = b.path, b.err
	}
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return paths
}

// RemoveBinaries removes the directory BuildBinary built into, for a
// TestMain to call after m.Run; a later BuildBinary builds afresh.
func RemoveBinaries() error {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if builds.dir == "" {
		return nil
	}
	err := os.RemoveAll(builds.dir)
	builds.dir, builds.bins = "", nil
	return err
}

// buildOf returns the build entry of pkg, creating it on first use.
func buildOf(pkg string) *build {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if builds.bins == nil {
		builds.bins = map[string]*build{}
	}
	b, ok := builds.bins[pkg]
	if !ok {
		b = &build{pkg: pkg}
		builds.bins[pkg] = b
	}
	return b
}

// goBuild runs `go build` for pkg in the module root and returns the binary,
// named after the package's last element in a folder of its own.
//
// When KVMESH_TEST_BIN_DIR names a directory holding a binary of that name
// (`make test` points it at .dev/testbin, where it has just built the
// services with -race), that binary is used instead: test packages running
// in parallel then do not each compile the services again.
func goBuild(pkg string) (string, error) {
	if dir := os.Getenv(binDirEnv); dir != "" {
		prebuilt := filepath.Join(dir, path.Base(pkg))
		if _, err := os.Stat(prebuilt); err == nil {
			return prebuilt, nil
		}
	}
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	dir, err := binDir()
	if err != nil {
		return "", err
	}
	gotool, err := goTool()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, filepath.FromSlash(pkg), path.Base(pkg))
	cmd := exec.Command(gotool, "build", "-ldflags=-s -w", "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = os.Environ()
	if os.Getenv("CGO_CFLAGS") == "" {
		cmd.Env = append(cmd.Env, "CGO_CFLAGS="+cgoCFlags)
	}
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", pkg, err, msg)
	}
	return out, nil
}

// binDir returns this process's binary directory, making it (and sweeping
// those of exited processes) on first use.
func binDir() (string, error) {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if builds.dir != "" {
		return builds.dir, nil
	}
	sweepBinDirs()
	dir := filepath.Join(os.TempDir(), binDirPrefix+strconv.Itoa(os.Getpid()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("binary directory: %w", err)
	}
	builds.dir = dir
	return dir, nil
}

// sweepBinDirs removes the binary directories of test processes that no
// longer exist; it leaves anything it cannot judge.
func sweepBinDirs() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), binDirPrefix+"*")) // only ErrBadPattern, impossible here
	for _, dir := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(dir), binDirPrefix))
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			_ = os.RemoveAll(dir) // best effort: a leftover is only disk space
		}
	}
}

// goTool returns the go command: the one on PATH (go test puts its own
// GOROOT/bin first), else $GOROOT/bin/go.
func goTool() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "bin", "go"), nil
	}
	return "", errors.New("go command not found on PATH and GOROOT is unset")
}

// ModuleRoot returns the directory holding go.mod, found by walking up from
// the test's working directory; the test fails when there is none.
func ModuleRoot(t testing.TB) string {
	t.Helper()
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// moduleRoot walks up from the working directory to the one with go.mod.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("module root: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the test's directory")
		}
		dir = parent
	}
}

// ServiceBinaries builds the services named (./services/<name> each, see
// BuildBinaries) and returns each binary's path by service name.
func ServiceBinaries(t testing.TB, names ...string) map[string]string {
	t.Helper()
	pkgs := make([]string, len(names))
	for i, name := range names {
		pkgs[i] = "./services/" + name
	}
	bins := make(map[string]string, len(names))
	for i, bin := range BuildBinaries(t, pkgs...) {
		bins[names[i]] = bin
	}
	return bins
}
