package testenv_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

const fakeService = "./internal/testenv/testdata/fakeservice"

// get GETs url and returns the body, failing the test unless it is 200.
func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %q %v", url, resp.StatusCode, b, err)
	}
	return string(b)
}

// addFake registers the fake service as name, failing the test on error.
func addFake(t *testing.T, ps *testenv.Procs, name string, env ...string) *testenv.Process {
	t.Helper()
	p, err := ps.Add(name, testenv.BuildBinary(t, fakeService), env...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestProcsEnvironment(t *testing.T) {
	t.Setenv("KVMESH_PROCS_INHERITED", "from the test")
	ps := testenv.NewProcs(t, "KVMESH_PROCS_COMMON=common", "KVMESH_PROCS_OVERRIDE=common")
	p := addFake(t, ps, "svc", "KVMESH_PROCS_OVERRIDE=extra", "FAKESERVICE_UNREADY=3")
	if ps.Process("svc") != p || ps.Process("other") != nil {
		t.Fatalf("Process(svc) = %p, Process(other) = %p; want %p and nil", ps.Process("svc"), ps.Process("other"), p)
	}
	if err := p.Start(); err != nil { // polls past three 503s
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, want string }{
		{"KVMESH_PROCS_INHERITED", "from the test"},
		{"KVMESH_PROCS_COMMON", "common"},
		{"KVMESH_PROCS_OVERRIDE", "extra"}, // the later setting wins
		{"KVMESH_HTTP_ADDR", p.Addr()},
	} {
		if got := get(t, p.URL()+"/env?name="+url.QueryEscape(tc.name)); got != tc.want {
			t.Errorf("%s = %q, want %q", tc.name, got, tc.want)
		}
	}
	if p.URL() != "http://"+p.Addr() || !strings.HasPrefix(p.Addr(), "127.0.0.1:") {
		t.Errorf("URL %q, Addr %q: want http:// and a loopback address", p.URL(), p.Addr())
	}
}

func TestProcsKillRestartStop(t *testing.T) {
	ps := testenv.NewProcs(t)
	p := addFake(t, ps, "svc")
	if err := p.Alive(); err == nil {
		t.Fatal("Alive before Start: nil error")
	}
	if err := p.Kill(); err == nil {
		t.Fatal("Kill before Start: nil error")
	}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	if err := p.Start(); err == nil {
		t.Fatal("a second Start of a running process: nil error")
	}
	if err := p.Alive(); err != nil {
		t.Fatalf("Alive after Start: %v", err)
	}
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := p.Alive(); !errors.Is(err, testenv.ErrExited) {
		t.Fatalf("Alive after Kill: %v, want ErrExited", err)
	}
	if err := p.Start(); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if err := p.Alive(); err != nil {
		t.Fatalf("Alive after the restart: %v", err)
	}
	addr := p.Addr()
	ps.StopAll()
	if err := p.Alive(); !errors.Is(err, testenv.ErrExited) {
		t.Fatalf("Alive after StopAll: %v, want ErrExited", err)
	}
	log := p.LogTail(10)
	if n := strings.Count(log, "listening on "+addr); n != 2 {
		t.Errorf("log has %d starts on %s, want 2 (the restart appends, same address):\n%s", n, addr, log)
	}
	if !strings.HasSuffix(log, "stopped by SIGTERM") {
		t.Errorf("log does not end with the SIGTERM stop:\n%s", log)
	}
	if last := p.LogTail(1); last != "stopped by SIGTERM" {
		t.Errorf("LogTail(1) = %q", last)
	}
}

func TestProcsStartFailsWhenTheProcessExits(t *testing.T) {
	ps := testenv.NewProcs(t)
	p := addFake(t, ps, "doomed", "FAKESERVICE_EXIT=no configuration, giving up")
	err := p.Start()
	if !errors.Is(err, testenv.ErrExited) {
		t.Fatalf("Start: %v, want ErrExited", err)
	}
	if !strings.Contains(err.Error(), "no configuration, giving up") {
		t.Errorf("Start's error lacks the log's last line: %v", err)
	}
}

// TestProcsStartIsNotFooledByAnotherListener holds a process's port with a
// server of the test's own that answers /readyz 200: the process cannot bind,
// and Start must report its exit instead of taking the impostor's 200 for
// its readiness.
func TestProcsStartIsNotFooledByAnotherListener(t *testing.T) {
	ps := testenv.NewProcs(t)
	p := addFake(t, ps, "svc")
	l, err := net.Listen("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	impostor := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})}
	go func() { _ = impostor.Serve(l) }() // returns ErrServerClosed at Close
	t.Cleanup(func() { impostor.Close() })
	err = p.Start()
	if !errors.Is(err, testenv.ErrExited) {
		t.Fatalf("Start with the port held by another server: %v, want ErrExited", err)
	}
	if !strings.Contains(err.Error(), "address already in use") {
		t.Errorf("Start's error lacks the bind failure: %v", err)
	}
}

// TestProcsPortsAreNeverHandedOutTwice adds many processes and checks
// that no two got the same address.
func TestProcsPortsAreNeverHandedOutTwice(t *testing.T) {
	ps := testenv.NewProcs(t)
	seen := map[string]string{}
	for i := range 500 {
		name := fmt.Sprintf("svc-%d", i)
		p := addFake(t, ps, name)
		if other, ok := seen[p.Addr()]; ok {
			t.Fatalf("%s got %s, already handed to %s", name, p.Addr(), other)
		}
		seen[p.Addr()] = name
	}
}

func TestProcsAddRejectsADuplicateName(t *testing.T) {
	ps := testenv.NewProcs(t)
	first := addFake(t, ps, "svc")
	if _, err := ps.Add("svc", "/bin/true"); err == nil {
		t.Fatal("a second Add of svc: nil error")
	}
	if ps.Process("svc") != first {
		t.Error("the duplicate Add replaced the first process")
	}
}

func TestProcsStoppedAtCleanup(t *testing.T) {
	before := goleak.IgnoreCurrent()
	var p *testenv.Process
	t.Run("owner", func(t *testing.T) {
		p = addFake(t, testenv.NewProcs(t), "svc")
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
	})
	if err := p.Alive(); !errors.Is(err, testenv.ErrExited) {
		t.Fatalf("Alive after the owning test ended: %v, want ErrExited", err)
	}
	goleak.VerifyNone(t, before) // no Wait or probe goroutine outlives its test
}

// cleanupRecorder is a test whose cleanups run when the test says and
// whose failure state and logs the test sets and reads.
type cleanupRecorder struct {
	testing.TB
	failed   bool
	logs     []string
	cleanups []func()
}

func (r *cleanupRecorder) Failed() bool { return r.failed }
func (r *cleanupRecorder) Logf(format string, args ...any) {
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
}
func (r *cleanupRecorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *cleanupRecorder) runCleanups() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func TestProcsLogTheirLogsWhenTheTestFailed(t *testing.T) {
	bin := testenv.BuildBinary(t, fakeService)
	for _, failed := range []bool{false, true} {
		rec := &cleanupRecorder{TB: t, failed: failed}
		ps := testenv.NewProcs(rec)
		for _, name := range []string{"b-svc", "a-svc"} {
			p, err := ps.Add(name, bin)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Start(); err != nil {
				t.Fatal(err)
			}
		}
		rec.logs = nil // the ready lines
		rec.runCleanups()
		var dumps []string
		for _, l := range rec.logs {
			if strings.HasPrefix(l, "--- ") {
				dumps = append(dumps, l)
			}
		}
		if !failed {
			if len(dumps) != 0 {
				t.Errorf("passing test: logs %q, want none", dumps)
			}
			continue
		}
		if len(dumps) != 2 || !strings.HasPrefix(dumps[0], "--- a-svc log") || !strings.HasPrefix(dumps[1], "--- b-svc log") {
			t.Fatalf("failed test: logs %q, want a-svc's then b-svc's", dumps)
		}
		for _, d := range dumps {
			if !strings.Contains(d, "listening on") || !strings.HasSuffix(d, "stopped by SIGTERM") {
				t.Errorf("log dump %q: want the whole short log, taken after the stop", d)
			}
		}
	}
}
