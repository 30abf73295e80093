package testenv

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Settings of the process harness.
const (
	// httpAddrEnv names the variable that gives a service its HTTP address.
	httpAddrEnv = "KVMESH_HTTP_ADDR"
	// readyWithin bounds the wait for a started process's /readyz.
	readyWithin = 60 * time.Second
	// readyPoll is the interval between two /readyz polls.
	readyPoll = 50 * time.Millisecond
	// probeTimeout bounds one /readyz or /healthz request.
	probeTimeout = 2 * time.Second
	// stopWithin is how long a process may take to exit after SIGTERM
	// before it is killed.
	stopWithin = 10 * time.Second
	// logTailLines is how many lines of a process's log a failure shows.
	logTailLines = 40
)

// Procs runs one test's service processes. Each is registered under a name
// with its binary, its environment and a loopback HTTP address of its own
// (KVMESH_HTTP_ADDR), and can be started, restarted on the same address and
// killed. When the test ends every running process is stopped (SIGTERM,
// then SIGKILL after 10 s) and, when the test failed, the last lines of
// each process's log are logged. Its methods may be called from any
// goroutine.
type Procs struct {
	t      testing.TB
	env    []string
	logDir string

	mu    sync.Mutex
	procs map[string]*Process
	tls   *tls.Config // UseHTTPS: the processes serve HTTPS, verified with it
}

// UseHTTPS says that the processes added from now on serve HTTPS (they are
// given a certificate in their environment): their URLs are https:// and
// their readiness is probed over TLS verified with client.
func (ps *Procs) UseHTTPS(client *tls.Config) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.tls = client
}

// Process is one process of a Procs. Its standard output and error go to a
// log file that restarts append to.
type Process struct {
	t    testing.TB
	name string
	bin  string
	env  []string
	addr string
	log  string
	tls  *tls.Config // nil: plain HTTP

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited and was reaped
}

// NewProcs returns an empty harness for the rest of the test; env is added
// to every process's environment.
func NewProcs(t testing.TB, env ...string) *Procs {
	t.Helper()
	ps := &Procs{t: t, env: env, logDir: t.TempDir(), procs: map[string]*Process{}}
	t.Cleanup(func() {
		ps.StopAll()
		ps.logTailsOnFailure()
	})
	return ps
}

// Add registers, without starting it, the process name running binary bin
// with this environment: the test process's own, then NewProcs's env, then
// env, then KVMESH_HTTP_ADDR set to a loopback address free right now.
// Each name may be added once.
func (ps *Procs) Add(name, bin string, env ...string) (*Process, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, fmt.Errorf("add %s: %w", name, err)
	}
	p := &Process{
		t: ps.t, name: name, bin: bin, addr: addr,
		env: slices.Concat(os.Environ(), ps.env, env, []string{httpAddrEnv + "=" + addr}),
		log: filepath.Join(ps.logDir, name+".log"),
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	p.tls = ps.tls
	if _, ok := ps.procs[name]; ok {
		return nil, fmt.Errorf("add %s: %w", name, errDuplicate)
	}
	ps.procs[name] = p
	return p, nil
}

// Process returns the process added as name, or nil when there is none.
func (ps *Procs) Process(name string) *Process {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return ps.procs[name]
}

// Names are the names of the processes added, sorted.
func (ps *Procs) Names() []string {
	all := ps.all()
	out := make([]string, len(all))
	for i, p := range all {
		out[i] = p.name
	}
	return out
}

// StopAll stops every running process at once (see Process.Stop) and
// returns when all have exited. The test's cleanup calls it too.
func (ps *Procs) StopAll() {
	var wg sync.WaitGroup
	for _, p := range ps.all() {
		wg.Go(p.Stop)
	}
	wg.Wait()
}

// all returns the processes, sorted by name.
func (ps *Procs) all() []*Process {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := make([]*Process, 0, len(ps.procs))
	for _, p := range ps.procs {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b *Process) int { return strings.Compare(a.name, b.name) })
	return out
}

// logTailsOnFailure logs the end of every process's log when the test
// failed.
func (ps *Procs) logTailsOnFailure() {
	if !ps.t.Failed() {
		return
	}
	for _, p := range ps.all() {
		ps.t.Logf("--- %s log (last lines) ---\n%s", p.name, p.LogTail(logTailLines))
	}
}

// Addr returns the process's HTTP address, host:port.
func (p *Process) Addr() string { return p.addr }

// URL returns the process's base URL, http://host:port (https:// after
// Procs.UseHTTPS).
func (p *Process) URL() string {
	if p.tls != nil {
		return "https://" + p.addr
	}
	return "http://" + p.addr
}

// Start starts the process, or restarts it after Kill or Stop on the same
// address, and waits until GET /readyz answers 200. It fails when the
// process is already running, exits before it is ready (ErrExited), or is
// not ready within 60 s; the error then carries the end of its log.
func (p *Process) Start() error {
	p.t.Helper()
	done, logFrom, err := p.launch()
	if err != nil {
		return err
	}
	if err := p.waitReady(done, logFrom); err != nil {
		return fmt.Errorf("%s: %w; log:\n%s", p.name, err, p.LogTail(logTailLines))
	}
	p.t.Logf("%s ready at %s", p.name, p.addr)
	return nil
}

// launch starts the binary with its output appended to the log and returns
// the channel that closes when it has exited and the log's size before it
// started.
func (p *Process) launch() (<-chan struct{}, int64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done != nil && !closed(p.done) {
		return nil, 0, fmt.Errorf("start %s: %w", p.name, errRunning)
	}
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, 0, fmt.Errorf("start %s: %w", p.name, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("start %s: %w", p.name, err)
	}
	cmd := exec.Command(p.bin)
	cmd.Env, cmd.Stdout, cmd.Stderr = p.env, f, f
	// The service dies with the test process: a test binary that panics
	// (a timeout) runs no cleanup, and its orphaned services, their broker
	// gone, would go on retrying and take the CPU of every later run.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait() // its exit status matters to tests only through readiness and Alive
		f.Close()
		close(done)
	}()
	p.cmd, p.done = cmd, done
	return done, st.Size(), nil
}

// waitReady polls /readyz until it answers 200 and the process's log, past
// logFrom, says it listens on its address (so that a 200 from another
// process that holds the port is not taken for this one's), the process
// exits (done closes) or readyWithin passes.
func (p *Process) waitReady(done <-chan struct{}, logFrom int64) error {
	hc := probeClient()
	if p.tls != nil {
		hc.Transport = &http.Transport{TLSClientConfig: p.tls}
	}
	defer hc.CloseIdleConnections()
	return poll(readyWithin, done, func() error {
		if err := probe(hc, p.URL()+"/readyz"); err != nil {
			return err
		}
		return p.listening(logFrom)
	})
}

// listening reports nil when the log, from byte from on, has a line that
// says the process listens on its address ("listening" and the address).
func (p *Process) listening(from int64) error {
	f, err := os.Open(p.log)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Seek(from, io.SeekStart); err != nil {
		return err
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if line := sc.Text(); strings.Contains(line, "listening") && strings.Contains(line, p.addr) {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return fmt.Errorf("/readyz answers, but %s has not logged that it listens on %s: %w", p.name, p.addr, errNotListening)
}

// WaitReady polls GET url (each request bounded to 2 s) until it answers
// 200, within passes, or stop closes (nil: never), which is reported as
// ErrExited: stop is meant to be a process's exit.
func WaitReady(url string, within time.Duration, stop <-chan struct{}) error {
	hc := probeClient()
	defer hc.CloseIdleConnections()
	return poll(within, stop, func() error { return probe(hc, url) })
}

// poll calls check every readyPoll until it returns nil, within passes or
// stop closes (reported as ErrExited).
func poll(within time.Duration, stop <-chan struct{}, check func() error) error {
	deadline := time.Now().Add(within)
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v: %w", within, err)
		}
		select {
		case <-stop:
			return fmt.Errorf("%w before it was ready (last answer: %w)", ErrExited, err)
		case <-tick.C:
		}
	}
}

// PID is the running process's id, 0 when it is not running.
func (p *Process) PID() int {
	cmd, done := p.current()
	if cmd == nil || closed(done) {
		return 0
	}
	return cmd.Process.Pid
}

// Kill sends SIGKILL and returns once the process has exited.
func (p *Process) Kill() error {
	cmd, done := p.current()
	if cmd == nil {
		return fmt.Errorf("kill %s: %w", p.name, errNotStarted)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill %s: %w", p.name, err)
	}
	<-done
	return nil
}

// Stop sends SIGTERM, and SIGKILL when the process has not exited within
// 10 s; it returns once the process has exited, at once when it is not
// running.
func (p *Process) Stop() {
	cmd, done := p.current()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM) // fails only when it already exited, which done reports
	timer := time.NewTimer(stopWithin)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		_ = cmd.Process.Kill() // as above
		<-done
	}
}

// Alive reports whether the process is running and answers GET /healthz
// and GET /readyz with 200; the error says what is wrong.
func (p *Process) Alive() error {
	_, done := p.current()
	switch {
	case done == nil:
		return fmt.Errorf("%s: %w", p.name, errNotStarted)
	case closed(done):
		return fmt.Errorf("%s: %w", p.name, ErrExited)
	}
	hc := probeClient()
	defer hc.CloseIdleConnections()
	for _, path := range []string{"/healthz", "/readyz"} {
		if err := probe(hc, p.URL()+path); err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
	}
	return nil
}

// LogTail returns the last n lines of the process's log, or why it could
// not be read.
func (p *Process) LogTail(n int) string {
	f, err := os.Open(p.log)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	if err := sc.Err(); err != nil {
		lines = append(lines, "(reading the log: "+err.Error()+")")
	}
	return strings.Join(lines, "\n")
}

// current returns the running (or last) command and its done channel; both
// are nil before the first Start.
func (p *Process) current() (*exec.Cmd, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd, p.done
}

// probeClient returns an HTTP client of its own, so that the caller can
// close its connections and leave no goroutine behind.
func probeClient() *http.Client {
	return &http.Client{Timeout: probeTimeout, Transport: &http.Transport{}}
}

// probe GETs url and expects 200.
func probe(hc *http.Client, url string) error {
	resp, err := hc.Get(url)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}

// closed reports whether ch is closed.
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
