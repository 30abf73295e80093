package kvstore_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisServer is a throwaway redis-server owned by one test.
type redisServer struct {
	URL      string
	cmd      *exec.Cmd
	output   bytes.Buffer
	stopOnce sync.Once
}

// startRedisServer starts a private redis-server with no persistence and
// extra arguments, waits until it answers PING, and stops it in Cleanup.
// Without redis-server on PATH the test is skipped, or fails when
// KVMESH_REQUIRE_SERVICES=1.
func startRedisServer(t *testing.T, args ...string) *redisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("KVMESH_REQUIRE_SERVICES") == "1" {
			t.Fatalf("redis-server not on PATH: %v", err)
		}
		t.Skipf("redis-server not on PATH: %v", err)
	}
	port := freePort(t)
	base := []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", t.TempDir()}
	s := &redisServer{URL: fmt.Sprintf("redis://127.0.0.1:%s/0", port)}
	s.cmd = exec.Command(bin, append(base, args...)...)
	s.cmd.Stdout, s.cmd.Stderr = &s.output, &s.output
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	t.Cleanup(s.Stop)
	if err := s.waitReady(10 * time.Second); err != nil {
		s.Stop()
		t.Fatalf("redis-server on port %s: %v\n%s", port, err, s.output.String())
	}
	return s
}

// Stop kills the server and waits for it to exit; later calls do nothing.
func (s *redisServer) Stop() {
	s.stopOnce.Do(func() {
		_ = s.cmd.Process.Kill() // fails only if it already exited, which Wait reports
		_ = s.cmd.Wait()         // a killed process exits with an error by design
	})
}

// waitReady polls PING until it succeeds or the deadline passes.
func (s *redisServer) waitReady(limit time.Duration) error {
	ro, err := redis.ParseURL(s.URL)
	if err != nil {
		return err
	}
	ro.MaxRetries = -1
	c := redis.NewClient(ro)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := c.Ping(ctx).Err()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no PING reply within %v: %w", limit, err)
		case <-tick.C:
		}
	}
}

// freePort returns a TCP port that was free a moment ago on 127.0.0.1.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer l.Close()
	_, port, err := net.SplitHostPort(l.Addr().String())
	if err != nil {
		t.Fatalf("free port address: %v", err)
	}
	return port
}
