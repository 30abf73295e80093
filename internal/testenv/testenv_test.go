package testenv_test

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

const hello = "./internal/testenv/testdata/hello"

// command sends one inline command to addr and returns the reply's lines.
func command(addr, cmd string, lines int) ([]string, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
		return nil, err
	}
	if _, err := c.Write([]byte(cmd + "\r\n")); err != nil {
		return nil, err
	}
	r := bufio.NewReader(c)
	var got []string
	for range lines {
		line, err := r.ReadString('\n')
		if err != nil {
			return got, err
		}
		got = append(got, strings.TrimSpace(line))
	}
	return got, nil
}

func TestStartRedisServesWithExtraArgsAndStops(t *testing.T) {
	s := testenv.StartRedis(t, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
	if want := "redis://" + s.Addr() + "/0"; s.URL() != want {
		t.Errorf("URL() = %q, want %q", s.URL(), want)
	}
	// CONFIG GET answers *2, $9, maxmemory, $7, 3145728.
	got, err := command(s.Addr(), "CONFIG GET maxmemory", 5)
	if err != nil {
		t.Fatalf("CONFIG GET maxmemory: %v (%q)", err, got)
	}
	if got[4] != strconv.Itoa(3<<20) {
		t.Errorf("maxmemory = %q, want %d", got[4], 3<<20)
	}
	got, err = command(s.Addr(), "CONFIG GET save", 5)
	if err != nil || got[4] != "" {
		t.Errorf("CONFIG GET save = %q, %v; want persistence off", got, err)
	}
	if !strings.Contains(s.Output(), "Ready to accept connections") {
		t.Errorf("Output() lacks the ready line:\n%s", s.Output())
	}

	s.Stop()
	s.Stop() // idempotent, as is the call at cleanup
	if _, err := command(s.Addr(), "PING", 1); err == nil {
		t.Error("PING answered after Stop")
	}
}

func TestStartRedisSkipsWithoutServer(t *testing.T) {
	t.Setenv("KVMESH_REQUIRE_SERVICES", "")
	t.Setenv("PATH", t.TempDir())
	var sub *testing.T
	t.Run("no redis-server", func(t *testing.T) {
		sub = t
		testenv.StartRedis(t)
		t.Error("StartRedis returned without redis-server on PATH")
	})
	if !sub.Skipped() {
		t.Error("test without redis-server was not skipped")
	}
}

func TestModuleRoot(t *testing.T) {
	root := testenv.ModuleRoot(t)
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("ModuleRoot() = %q: %v", root, err)
	}
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	if wd != filepath.Join(root, "internal", "testenv") {
		t.Errorf("working directory %q is not internal/testenv under %q", wd, root)
	}
}

func TestBuildBinaryBuildsOncePerProcess(t *testing.T) {
	bin := testenv.BuildBinary(t, hello)
	wantDir := filepath.Join(os.TempDir(), "kvmesh-testbin-"+strconv.Itoa(os.Getpid()))
	if !strings.HasPrefix(bin, wantDir+string(filepath.Separator)) || filepath.Base(bin) != "hello" {
		t.Errorf("binary at %q, want %s/…/hello", bin, wantDir)
	}
	info, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin).Output()
	if err != nil || string(out) != "hello from a built binary\n" {
		t.Fatalf("run %s: %q, %v", bin, out, err)
	}
	for _, spelling := range []string{hello, hello + "/", "./internal/testenv/../testenv/testdata/hello"} {
		again := testenv.BuildBinary(t, spelling)
		after, err := os.Stat(again)
		if err != nil {
			t.Fatal(err)
		}
		if again != bin || !after.ModTime().Equal(info.ModTime()) {
			t.Errorf("BuildBinary(%q) = %q (%v), want the first build %q (%v)", spelling, again, after.ModTime(), bin, info.ModTime())
		}
	}
}

func TestBuildBinarySweepsDirsOfExitedProcesses(t *testing.T) {
	exited := exec.Command("true")
	if err := exited.Run(); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(os.TempDir(), "kvmesh-testbin-"+strconv.Itoa(exited.Process.Pid))
	live := filepath.Join(os.TempDir(), "kvmesh-testbin-"+strconv.Itoa(os.Getppid()))
	for _, dir := range []string{stale, live} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
	}

	if err := testenv.RemoveBinaries(); err != nil {
		t.Fatal(err)
	}
	bin := testenv.BuildBinary(t, hello) // a fresh directory, so a sweep
	if _, err := os.Stat(bin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("directory of exited pid %d still there (%v)", exited.Process.Pid, err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("directory of live pid %d removed: %v", os.Getppid(), err)
	}

	if err := testenv.RemoveBinaries(); err != nil {
		t.Fatal(err)
	}
	own := filepath.Join(os.TempDir(), "kvmesh-testbin-"+strconv.Itoa(os.Getpid()))
	if _, err := os.Stat(own); !os.IsNotExist(err) {
		t.Errorf("RemoveBinaries left %s (%v)", own, err)
	}
}
