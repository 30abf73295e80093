package testenv

import (
	"bufio"
	"fmt"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// RedisServer is a private redis-server that StartRedis started for one
// test: no persistence, bound to 127.0.0.1 on a port of its own.
type RedisServer struct {
	*serverProcess
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

// startRedisOn starts redis-server on port (empty: a free one each
// attempt) and waits until it answers PING.
func startRedisOn(t testing.TB, port string, args []string) *RedisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		unavailable(t, "redis-server is not on PATH (%v); install redis-server", err)
	}
	dir := t.TempDir()
	launch := func(int) (*serverProcess, error) {
		p := port
		if p == "" {
			if p, err = freePort(); err != nil {
				return nil, err
			}
		}
		base := []string{"--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir}
		return launchServer("redis-server", bin, net.JoinHostPort("127.0.0.1", p), append(base, args...))
	}
	return &RedisServer{startServer(t, launch, func(s *serverProcess) error { return ping(s.addr) })}
}

// URL returns the server's address as a redis:// URL for database 0.
func (s *RedisServer) URL() string {
	return "redis://" + s.addr + "/0"
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

// handedOut holds every port freeAddr has returned in this test binary, so
// that two processes of one test never get the same port: the kernel may
// hand a port it just freed to the next bind of port 0.
var handedOut = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// freeAddr returns a loopback address whose port was free a moment ago and
// was not returned before in this test binary.
func freeAddr() (string, error) {
	for range freeAddrTries {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", fmt.Errorf("find a free port: %w", err)
		}
		addr := l.Addr().(*net.TCPAddr)
		l.Close()
		handedOut.Lock()
		seen := handedOut.ports[addr.Port]
		handedOut.ports[addr.Port] = true
		handedOut.Unlock()
		if !seen {
			return addr.String(), nil
		}
	}
	return "", fmt.Errorf("find a free port: %d tries gave ports already handed out", freeAddrTries)
}

// FreeAddr returns a loopback address (host:port) whose port was free a
// moment ago and was not handed out before in this test binary, for a
// process the test starts itself; it fails the test when none is found.
func FreeAddr(t testing.TB) string {
	t.Helper()
	addr, err := freeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// freeAddrTries bounds the binds of port 0 one freeAddr call makes.
const freeAddrTries = 100
