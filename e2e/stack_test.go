package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/pkg/database/dbtest"
	"github.com/kvmesh/kvmesh/pkg/devbroker"
	"github.com/kvmesh/kvmesh/pkg/testenv"
)

// Engine ids of the two gpuworkers every stack runs.
const (
	decodeEngine  = "decode-0"
	prefillEngine = "prefill-0"
	adminToken    = "e2e-admin-token"
)

// services are the service binaries every stack runs.
var services = []string{"lookup", "scheduler", "sender", "gpuworker"}

// serviceBinaries builds ./services/* (once per test process, see
// testenv.BuildBinary) and returns each binary's path by service name.
func serviceBinaries(t *testing.T) map[string]string {
	t.Helper()
	pkgs := make([]string, len(services))
	for i, name := range services {
		pkgs[i] = "./services/" + name
	}
	bins := map[string]string{}
	for i, bin := range testenv.BuildBinaries(t, pkgs...) {
		bins[services[i]] = bin
	}
	return bins
}

// stackOptions shape one test's stack.
type stackOptions struct {
	// model is the KVMESH_MODEL of every service.
	model string
	// connectors is the lookup's chain.
	connectors string
	// poolBlocks is every gpuworker's KVMESH_POOL_BLOCKS.
	poolBlocks int
}

// stack is the mesh of one test: an in-process broker, a fresh database, the
// shared Redis under a key prefix of its own, and the services as
// subprocesses (lookup, scheduler, sender, and a gpuworker per engine).
type stack struct {
	t        *testing.T
	brokers  []string
	redisURL string
	prefix   string // KVMESH_KEY_PREFIX
	procs    map[string]*proc
	logDir   string
}

// proc is one service process, restartable on the same address.
type proc struct {
	name string
	bin  string
	env  []string
	addr string
	log  string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// newStack starts everything and waits until every service is ready.
func newStack(t *testing.T, o stackOptions) *stack {
	t.Helper()
	redisURL := testenv.RedisURL(t) // skips (or fails) before anything is built
	dbURL := dbtest.NewDatabase(t)
	bins := serviceBinaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", GroupMinSessionTimeout: time.Second})
	if err != nil {
		t.Fatalf("broker: %v", err)
	}
	t.Cleanup(b.Close)
	s := &stack{t: t, brokers: b.Addrs(), procs: map[string]*proc{}, logDir: t.TempDir()}
	prefix := randomPrefix()
	s.redisURL, s.prefix = redisURL, prefix
	t.Cleanup(func() { dropKeys(t, redisURL, prefix) })
	common := []string{
		"KVMESH_KAFKA_BROKERS=" + strings.Join(s.brokers, ","),
		"KVMESH_MODEL=" + o.model,
		"KVMESH_ADMIN_TOKEN=" + adminToken,
		"KVMESH_DATABASE_URL=" + dbURL,
		"KVMESH_REDIS_URL=" + redisURL,
		"KVMESH_KEY_PREFIX=" + prefix,
		"KVMESH_LOG_LEVEL=info",
		"KVMESH_SHUTDOWN_TIMEOUT=3s",
		// Short group sessions, so that a killed consumer's partitions move
		// to its replacement quickly.
		"KVMESH_KAFKA_SESSION_TIMEOUT=3s",
		"KVMESH_CONSUMER_SESSION_TIMEOUT=3s",
	}
	pool := fmt.Sprintf("KVMESH_POOL_BLOCKS=%d", o.poolBlocks)
	s.add("scheduler", bins, common, "KVMESH_MIGRATE=true")
	s.start("scheduler") // it migrates the database the others check
	s.add("lookup", bins, common, "KVMESH_LOOKUP_CONNECTORS="+o.connectors)
	s.add("sender", bins, common)
	s.addAs("gpuworker", "gpuworker", bins, common, "KVMESH_ENGINE_ID="+decodeEngine, pool)
	s.addAs("gpuworker-prefill", "gpuworker", bins, common, "KVMESH_ENGINE_ID="+prefillEngine, pool)
	for _, name := range []string{"lookup", "sender", "gpuworker", "gpuworker-prefill"} {
		s.start(name)
	}
	t.Cleanup(s.stopAll)
	t.Cleanup(s.dumpLogsOnFailure)
	return s
}

// dropKeys deletes the test's keys from the shared Redis.
func dropKeys(t *testing.T, redisURL, prefix string) {
	err := eachKeyBatch(redisURL, prefix, func(ctx context.Context, c *redis.Client, keys []string) error {
		return c.Del(ctx, keys...).Err()
	})
	if err != nil {
		t.Errorf("delete the test's keys: %v", err)
	}
}

// eachKeyBatch calls f with every key under prefix in the shared Redis, in
// batches.
func eachKeyBatch(redisURL, prefix string, f func(ctx context.Context, c *redis.Client, keys []string) error) error {
	ro, err := redis.ParseURL(redisURL)
	if err != nil {
		return err
	}
	c := redis.NewClient(ro)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	it := c.Scan(ctx, 0, prefix+"@*", 1000).Iterator()
	var keys []string
	for it.Next(ctx) {
		keys = append(keys, it.Val())
	}
	if err := it.Err(); err != nil {
		return err
	}
	for len(keys) > 0 {
		n := min(len(keys), 1000)
		if err := f(ctx, c, keys[:n]); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

func randomPrefix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "e2e" + hex.EncodeToString(b[:])
}

func (s *stack) add(name string, bins map[string]string, common []string, extra ...string) {
	s.addAs(name, name, bins, common, extra...)
}

// addAs registers a process named name running binary bin on a free port.
func (s *stack) addAs(name, bin string, bins map[string]string, common []string, extra ...string) {
	addr := freeAddr(s.t)
	env := append(os.Environ(), common...)
	env = append(env, extra...)
	env = append(env, "KVMESH_HTTP_ADDR="+addr)
	s.procs[name] = &proc{name: name, bin: bins[bin], env: env, addr: addr, log: filepath.Join(s.logDir, name+".log")}
}

// url is a service's base URL.
func (s *stack) url(name string) string { return "http://" + s.procs[name].addr }

// start starts (or restarts) a process and waits for its /readyz.
func (s *stack) start(name string) {
	s.t.Helper()
	p := s.procs[name]
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	cmd := exec.Command(p.bin)
	cmd.Env, cmd.Stdout, cmd.Stderr = p.env, f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		s.t.Fatalf("start %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait() // the exit status is the test's business only through readiness
		f.Close()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	s.waitReady(p)
}

// waitReady polls /readyz until 200, failing the test after 60 s or when
// the process exits.
func (s *stack) waitReady(p *proc) {
	s.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://" + p.addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-p.done:
			s.t.Fatalf("%s exited before it was ready; log:\n%s", p.name, tail(p.log, 40))
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s not ready after 60 s; log:\n%s", p.name, tail(p.log, 40))
		}
		time.Sleep(100 * time.Millisecond) // polling interval, not synchronisation
	}
}

// kill sends SIGKILL and waits until the process is gone.
func (s *stack) kill(name string) {
	s.t.Helper()
	p := s.procs[name]
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		s.t.Fatalf("kill %s: %v", name, err)
	}
	<-done
}

// stopAll stops every process: SIGTERM, then SIGKILL after 10 s.
func (s *stack) stopAll() {
	var wg sync.WaitGroup
	for _, p := range s.procs {
		p.mu.Lock()
		cmd, done := p.cmd, p.done
		p.mu.Unlock()
		if cmd == nil {
			continue
		}
		wg.Go(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		})
	}
	wg.Wait()
}

// alive reports whether the process is running and answers /healthz and
// /readyz with 200.
func (s *stack) alive(name string) error {
	p := s.procs[name]
	select {
	case <-p.done:
		return fmt.Errorf("%s exited", name)
	default:
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		resp, err := http.Get("http://" + p.addr + path)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s %s: %d", name, path, resp.StatusCode)
		}
	}
	return nil
}

func (s *stack) dumpLogsOnFailure() {
	if !s.t.Failed() {
		return
	}
	for name, p := range s.procs {
		s.t.Logf("--- %s log (last lines) ---\n%s", name, tail(p.log, 30))
	}
}

// freeAddr returns a loopback address with a port free right now.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	f, err := os.Open(path)
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
	return strings.Join(lines, "\n")
}
