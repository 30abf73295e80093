package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
)

// cliToken is the admin token of the services the CLI tests run.
const cliToken = "cli-admin-token"

// cliStack is the mesh the CLI tests run against: the embedded broker, a
// fresh database, the shared Redis under a key prefix of its own, and the
// service binaries as subprocesses.
type cliStack struct {
	t       *testing.T
	brokers []string
	common  []string // every process's settings
	prefix  string   // KVMESH_KEY_PREFIX
	mesh    *meshtest.Mesh
}

// newCLIStack starts the broker, the scheduler (which migrates the
// database), then the lookup, the sender and a gpuworker for engine, and
// waits until all are ready.
func newCLIStack(t *testing.T, engine string) *cliStack {
	t.Helper()
	m := meshtest.New(t, "cli",
		"KVMESH_KAFKA_PARTITIONS=2", "KVMESH_MODEL=hybrid-mla-linear", "KVMESH_ADMIN_TOKEN="+cliToken,
		"KVMESH_LOG_LEVEL=info", "KVMESH_SHUTDOWN_TIMEOUT=3s", "KVMESH_KAFKA_SESSION_TIMEOUT=3s",
		"KVMESH_POOL_BLOCKS=64", "KVMESH_MAINTENANCE_INTERVAL=200ms",
		"KVMESH_SENDER_RETRY_ATTEMPTS=2", "KVMESH_SENDER_RETRY_BASE=10ms", "KVMESH_SENDER_RETRY_MAX=20ms",
	)
	s := &cliStack{t: t, brokers: m.Brokers, common: m.Env, prefix: m.Prefix, mesh: m}
	s.start("scheduler", "scheduler", "KVMESH_MIGRATE=true")
	var wg sync.WaitGroup
	for _, p := range [][]string{{"lookup", "lookup"}, {"sender", "sender"}, {"gpuworker", "gpuworker", "KVMESH_ENGINE_ID=" + engine}} {
		wg.Go(func() { s.start(p[0], p[1], p[2:]...) })
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	return s
}

// start runs service bin as process name with the stack's settings plus
// extra, and waits until its /readyz answers 200; the test's cleanup stops
// it. It may run on another goroutine than the test's, so a failure fails
// the test without stopping it.
func (s *cliStack) start(name, bin string, extra ...string) {
	if _, err := s.mesh.Start(name, bin, extra...); err != nil {
		s.t.Error(err)
	}
}

// url is the base URL of process name, or "" when there is none.
func (s *cliStack) url(name string) string {
	if p := s.mesh.Procs.Process(name); p != nil {
		return p.URL()
	}
	return ""
}

// flags are the CLI flags pointing at the stack's services, with the
// operator token (every admin route needs it, reads included).
func (s *cliStack) flags() []string {
	return append(s.tokenless(), "--token", cliToken)
}

// tokenless are flags without the operator token.
func (s *cliStack) tokenless() []string {
	return []string{"--lookup-url", s.url("lookup"), "--scheduler-url", s.url("scheduler"),
		"--sender-url", s.url("sender"), "--gpuworker-url", s.url("gpuworker"), "--timeout", "20s"}
}

// publish writes messages to the stack's broker.
func (s *cliStack) publish(msgs ...bus.Message) {
	s.t.Helper()
	p, err := bus.NewProducer(s.brokers)
	if err != nil {
		s.t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := p.Publish(ctx, msgs...); err != nil {
		s.t.Fatal(err)
	}
}

// getJSON GETs url and decodes the JSON answer into v.
func (s *cliStack) getJSON(url string, v any) {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+cliToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		s.t.Fatalf("GET %s: %d: %v", url, resp.StatusCode, err)
	}
}

// eventually polls cond until it holds, failing the test after 30 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		<-tick.C
	}
}

// cliRun is one CLI invocation's outcome.
type cliRun struct {
	stdout, stderr string
	code           int
}

// runCLI runs kvmesh with args in process, as main does, capturing its
// output. Tests using it must not run in parallel.
func runCLI(t *testing.T, args ...string) cliRun {
	t.Helper()
	var out, errOut bytes.Buffer
	oldOut, oldErr := stdout, stderr
	stdout, stderr = &out, &errOut
	defer func() { stdout, stderr = oldOut, oldErr }()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	code := exitCode(dispatch(ctx, args))
	r := cliRun{stdout: out.String(), stderr: errOut.String(), code: code}
	t.Logf("kvmesh %s → exit %d\n%s%s", strings.Join(args, " "), code, r.stdout, r.stderr)
	return r
}

// ok fails the test unless the run exited 0.
func (r cliRun) ok(t *testing.T) cliRun {
	t.Helper()
	if r.code != 0 {
		t.Fatalf("exit %d, want 0; stderr:\n%s", r.code, r.stderr)
	}
	return r
}

// fails fails the test unless the run exited 1 with want on stderr.
func (r cliRun) fails(t *testing.T, want ...string) cliRun {
	t.Helper()
	if r.code != 1 {
		t.Fatalf("exit %d, want 1", r.code)
	}
	for _, w := range want {
		if !strings.Contains(r.stderr, w) {
			t.Fatalf("stderr %q lacks %q", r.stderr, w)
		}
	}
	return r
}

// rows returns the fields of each table row of stdout: the header and the
// trailing lines ("next cursor: …", "replay: …", "dry run: …") excluded.
func (r cliRun) rows() [][]string {
	var out [][]string
	lines := strings.Split(strings.TrimRight(r.stdout, "\n"), "\n")
	for _, l := range lines[min(1, len(lines)):] {
		f := strings.Fields(l)
		if len(f) == 0 || strings.HasSuffix(f[0], ":") || len(f) > 1 && strings.HasSuffix(f[1], ":") {
			continue
		}
		out = append(out, f)
	}
	return out
}
