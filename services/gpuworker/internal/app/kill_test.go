package app_test

import (
	"bytes"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// stallProxy forwards TCP connections to a Redis server. Once armed, the
// first client chunk carrying a GET is held back (never forwarded) and
// stalled is closed: the worker is then inside a load, waiting on the store.
type stallProxy struct {
	ln      net.Listener
	target  string
	mu      sync.Mutex
	armed   bool
	stalled chan struct{}
	wg      sync.WaitGroup
	conns   []net.Conn
}

func startStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{ln: ln, target: target, stalled: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *stallProxy) arm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = true
}

func (p *stallProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); _, _ = io.Copy(c, s); _ = c.Close() }()
		go func() { defer p.wg.Done(); p.forward(s, c); _ = s.Close() }()
	}
}

// forward copies client bytes to the server, holding back the first GET
// after arm.
func (p *stallProxy) forward(dst, src net.Conn) {
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && p.holds(buf[:n]) {
			_, _ = io.Copy(io.Discard, src) // swallow until the client dies
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *stallProxy) holds(chunk []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.armed || !bytes.Contains(bytes.ToLower(chunk), []byte("\r\nget\r\n")) {
		return false
	}
	p.armed = false
	close(p.stalled)
	return true
}

// process is a gpuworker running as a subprocess.
type process struct {
	cmd  *exec.Cmd
	out  *bytes.Buffer
	addr string
	once sync.Once
}

// runWorker starts bin with the environment of cfg and waits until ready.
func runWorker(t *testing.T, bin string, cfg map[string]string) *process {
	t.Helper()
	p := &process{out: &bytes.Buffer{}, addr: testenv.FreeAddr(t)}
	p.cmd = exec.Command(bin)
	p.cmd.Env = []string{"KVMESH_HTTP_ADDR=" + p.addr, "PATH=" + os.Getenv("PATH")}
	for k, v := range cfg {
		p.cmd.Env = append(p.cmd.Env, k+"="+v)
	}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	servicetest.WaitReady(t, p.addr)
	return p
}

// processVars is the environment of a gpuworker process configured like
// cfg, on env's PostgreSQL and Kafka and the Redis at redisURL.
func processVars(env *servicetest.Env, cfg app.Config, redisURL string) map[string]string {
	return map[string]string{
		"KVMESH_ENGINE_ID": cfg.EngineID, "KVMESH_DATABASE_URL": env.DatabaseURL, "KVMESH_REDIS_URL": redisURL,
		"KVMESH_AUTH": "off", "KVMESH_KAFKA_BROKERS": strings.Join(env.Brokers, ","), "KVMESH_KAFKA_PARTITIONS": "2",
		"KVMESH_KAFKA_SESSION_TIMEOUT": "2s", "KVMESH_POOL_BLOCKS": "16", "KVMESH_KEY_PREFIX": cfg.KeyPrefix,
		"KVMESH_LOG_LEVEL": "warn", "KVMESH_SHUTDOWN_TIMEOUT": "2s",
	}
}

// view is the test's own view of the process, for keys and blocks: the
// default model (hybrid-mla-linear) under cfg's key prefix, cleaned at the
// end of the test.
func (p *process) view(t *testing.T, cfg app.Config) *worker {
	t.Helper()
	w := &worker{cfg: cfg, client: dataplane.NewClient("http://"+p.addr, nil), addr: p.addr}
	var err error
	if w.model, err = kvcore.Preset("hybrid-mla-linear"); err != nil {
		t.Fatal(err)
	}
	if w.keys, err = kvcore.NewKeyBuilder(cfg.KeyPrefix, w.model); err != nil {
		t.Fatal(err)
	}
	cleanPrefix(t, cfg.RedisURL, cfg.KeyPrefix)
	return w
}

// kill sends SIGKILL and reaps the process; later calls do nothing.
func (p *process) kill() {
	p.once.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL) // fails only if it already exited
		_ = p.cmd.Wait()                          // a killed process exits with an error by design
	})
}

// TestKilledMidLoadIsRedeliveredAndReported SIGKILLs a gpuworker while its
// load waits on the store; the replacement gets the uncommitted task again,
// loads it and publishes the result (with the block whose key is missing as
// a load error) within the deadline: the request does not hang.
func TestKilledMidLoadIsRedeliveredAndReported(t *testing.T) {
	t.Parallel()
	bin := testenv.BuildBinary(t, "./services/gpuworker")
	env := servicetest.NewEnv(t)
	ru, err := url.Parse(env.RedisURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startStallProxy(t, ru.Host)
	proxied := *ru
	proxied.Host = proxy.ln.Addr().String()

	cfg := testConfig(env, "engine-killed")
	vars := processVars(env, cfg, proxied.String())
	first := runWorker(t, bin, vars)
	w := first.view(t, cfg)

	hashes := hexChain(w.model, tokens(48, 600))
	fp := w.model.Fingerprint()
	payloads := [][]byte{w.randomBlock(0), w.randomBlock(0), w.randomBlock(1)}
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 0, hashes[0]), dataplane.EncodeValue(fp, payloads[0]))
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 0, hashes[1]), dataplane.EncodeValue(fp, payloads[1]))
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 1, hashes[2]), dataplane.EncodeValue(fp, payloads[2]))
	// Group 0's third key is missing: the load must report block 3.
	task := w.loadTask(hashes, 48, kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 4}})

	rs := watchResults(t, env)
	proxy.arm()
	publishTask(t, publisher(t, env), task)
	select {
	case <-proxy.stalled:
	case <-time.After(waitFor):
		t.Fatalf("the worker never asked the store for the task's keys:\n%s", first.out)
	}
	first.kill()
	if got := rs.find(task.TaskID); len(got) != 0 {
		t.Fatalf("a result was published before the load finished: %+v", got)
	}

	second := runWorker(t, bin, vars)
	res := rs.wait(t, task.TaskID)
	w.client, w.addr = dataplane.NewClient("http://"+second.addr, nil), second.addr
	want := int64(len(payloads[0]) + len(payloads[1]) + len(payloads[2]))
	assertLoadResult(t, res, w, task, []kvcore.BlockID{3}, want)
	w.assertBlock(t, 0, 1, hashes[0], payloads[0], "the redelivered load did not write the block")
	w.assertBlock(t, 1, 4, hashes[2], payloads[2], "the redelivered load did not write the block")
	// A further redelivery (a rebalance) may publish again: with the same
	// result id and content, which the scheduler drops as a duplicate.
	for _, again := range rs.find(task.TaskID)[1:] {
		if again.ResultID != res.ResultID || !slices.Equal(again.LoadErrors, res.LoadErrors) || again.Bytes != res.Bytes {
			t.Fatalf("a second result differs: %+v vs %+v", again, res)
		}
	}
}
