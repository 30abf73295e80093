package testenv

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// redisReadyWithin bounds the wait for a started redis-server to answer PING.
const redisReadyWithin = 30 * time.Second

// redisStartAttempts is how often StartRedis tries a fresh port when
// redis-server exits before answering (another process took the port).
const redisStartAttempts = 3

// RedisServer is a private redis-server that StartRedis started for one
// test: no persistence, bound to 127.0.0.1 on a port of its own.
type RedisServer struct {
	addr     string
	cmd      *exec.Cmd
	out      *syncBuffer
	done     chan struct{} // closed once the process exited and was reaped
	stopOnce sync.Once
}

// StartRedis starts `redis-server --port N --bind 127.0.0.1 --save ""
// --appendonly no --dir <t.TempDir()>` followed by args (for example
// "--maxmemory", "3mb"), waits until it answers PING, and kills it when the
// test ends. Without redis-server on PATH the test is skipped, or fails when
// KVMESH_REQUIRE_SERVICES=1.
func StartRedis(t testing.TB, args ...string) *RedisServer {
	t.Helper()
	return startRedisOn(t, "", args)
}

// RestartRedis starts a new, empty redis-server (as StartRedis does) on the
// address of old, which must have been stopped: a test's store coming back
// after an outage, where the services still hold its address.
func RestartRedis(t testing.TB, old *RedisServer, args ...string) *RedisServer {
	t.Helper()
	_, port, err := net.SplitHostPort(old.addr)
	if err != nil {
		t.Fatalf("restart redis-server: %v", err)
	}
	return startRedisOn(t, port, args)
}

// startRedisOn starts redis-server on port (empty: a free one), retrying
// when it exits before answering.
func startRedisOn(t testing.TB, port string, args []string) *RedisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		unavailable(t, "redis-server is not on PATH (%v); install redis-server", err)
	}
	dir := t.TempDir()
	for attempt := 1; ; attempt++ {
		s, err := startRedis(bin, dir, port, args)
		if err != nil {
			t.Fatalf("start redis-server: %v", err)
		}
		t.Cleanup(s.Stop)
		err = s.waitReady(redisReadyWithin)
		if err == nil {
			return s
		}
		s.Stop()
		if !errors.Is(err, errRedisExited) || attempt == redisStartAttempts {
			t.Fatalf("redis-server on %s: %v\n%s", s.addr, err, s.Output())
		}
	}
}

// startRedis starts redis-server on port (empty: a free one); it does not
// wait for it.
func startRedis(bin, dir, port string, args []string) (*RedisServer, error) {
	if port == "" {
		var err error
		if port, err = freePort(); err != nil {
			return nil, err
		}
	}
	base := []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir}
	s := &RedisServer{
		addr: net.JoinHostPort("127.0.0.1", port),
		cmd:  exec.Command(bin, append(base, args...)...),
		out:  &syncBuffer{},
		done: make(chan struct{}),
	}
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

// URL returns the server's address as a redis:// URL for database 0.
func (s *RedisServer) URL() string {
	return "redis://" + s.addr + "/0"
}

// Addr returns the server's host:port.
func (s *RedisServer) Addr() string {
	return s.addr
}

// Output returns what the server has written to stdout and stderr so far.
// It is safe to call while the server runs.
func (s *RedisServer) Output() string {
	return s.out.String()
}

// Stop kills the server and waits until it has exited, for tests that take
// the store away mid-test. Later calls, and the one at cleanup, do nothing.
func (s *RedisServer) Stop() {
	s.stopOnce.Do(func() {
		_ = s.cmd.Process.Kill() // fails only if it already exited, which done reports
		<-s.done
	})
}

// waitReady polls PING until the server answers PONG, exits, or limit passes.
func (s *RedisServer) waitReady(limit time.Duration) error {
	deadline := time.Now().Add(limit)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := ping(s.addr)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no PONG within %v: %w", limit, err)
		}
		select {
		case <-s.done:
			return errRedisExited
		case <-tick.C:
		}
	}
}

// ping sends one PING over a fresh connection and expects +PONG.
func ping(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(time.Second)); err != nil {
		return err
	}
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if reply := strings.TrimSpace(line); reply != "+PONG" {
		return fmt.Errorf("PING answered %q", reply)
	}
	return nil
}

// freePort returns a TCP port that was free a moment ago on 127.0.0.1.
func freePort() (string, error) {
	addr, err := freeAddr()
	if err != nil {
		return "", err
	}
	_, port, err := net.SplitHostPort(addr)
	return port, err
}

// freeAddr returns a loopback address whose port was free a moment ago.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// syncBuffer is a bytes.Buffer that a process may write while a test reads.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p to the buffer.
func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns a copy of what was written so far.
func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
