package testenv

import (
	"errors"
	"fmt"
	"os/exec"
	"sync"
	"testing"
	"time"
)

// serverStartAttempts is how often startServer tries a fresh port when the
// server exits before it is ready (another process took the port).
const serverStartAttempts = 3

// serverReadyWithin bounds the wait for a started server to be ready.
const serverReadyWithin = 30 * time.Second

// serverProcess is one private server program a test started (redis-server,
// prometheus) on a loopback address of its own: its output is kept, and it
// is killed when the test ends.
type serverProcess struct {
	name     string // the program, for messages
	addr     string
	cmd      *exec.Cmd
	out      *SyncBuffer
	done     chan struct{} // closed once the process exited and was reaped
	stopOnce sync.Once
}

// launchServer starts bin with args, to listen on addr; it does not wait
// for it.
func launchServer(name, bin, addr string, args []string) (*serverProcess, error) {
	s := &serverProcess{name: name, addr: addr, cmd: exec.Command(bin, args...), out: &SyncBuffer{}, done: make(chan struct{})}
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		_ = s.cmd.Wait() // a killed server exits with an error by design
		close(s.done)
	}()
	return s, nil
}

// startServer launches a server with launch (attempt counts from 1), kills
// it when the test ends and waits until ready answers nil. A server that
// exits before it is ready is launched again, up to serverStartAttempts
// times; any other failure fails the test with the server's output.
func startServer(t testing.TB, launch func(attempt int) (*serverProcess, error), ready func(*serverProcess) error) *serverProcess {
	t.Helper()
	for attempt := 1; ; attempt++ {
		s, err := launch(attempt)
		if err != nil {
			t.Fatalf("start %v", err)
		}
		t.Cleanup(s.Stop)
		err = s.waitReady(serverReadyWithin, func() error { return ready(s) })
		if err == nil {
			return s
		}
		s.Stop()
		if !errors.Is(err, errServerExited) || attempt == serverStartAttempts {
			t.Fatalf("%s on %s: %v\n%s", s.name, s.addr, err, s.Output())
		}
	}
}

// Addr returns the server's host:port.
func (s *serverProcess) Addr() string {
	return s.addr
}

// Output returns what the server has written to stdout and stderr so far.
// It is safe to call while the server runs.
func (s *serverProcess) Output() string {
	return s.out.String()
}

// Stop kills the server and waits until it has exited, for tests that take
// a server away mid-test. Later calls, and the one at cleanup, do nothing.
func (s *serverProcess) Stop() {
	s.stopOnce.Do(func() {
		_ = s.cmd.Process.Kill() // fails only if it already exited, which done reports
		<-s.done
	})
}

// waitReady polls ready every 20 ms until it answers nil, the server
// exits (errServerExited), or limit passes.
func (s *serverProcess) waitReady(limit time.Duration, ready func() error) error {
	deadline := time.Now().Add(limit)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := ready()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready within %v: %w", limit, err)
		}
		select {
		case <-s.done:
			return fmt.Errorf("%s: %w", s.name, errServerExited)
		case <-tick.C:
		}
	}
}
