package app_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

// waitFor bounds every poll of the service tests.
const waitFor = 30 * time.Second

// process is a service binary running as a subprocess.
type process struct {
	cmd  *exec.Cmd
	log  string
	done chan struct{} // closed once the process exited
}

// startProcess runs bin with env; the test's cleanup stops it (SIGTERM,
// then SIGKILL) and shows its log when the test failed.
func startProcess(t testing.TB, bin string, env map[string]string) *process {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), filepath.Base(bin)+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &process{cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait() // a killed process exits with an error by design
		_ = logFile.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			if len(b) > 8000 {
				b = b[len(b)-8000:]
			}
			t.Logf("%s log (tail):\n%s", filepath.Base(bin), b)
		}
	})
	return p
}

// stop ends the process gracefully, or kills it after 5 s.
func (p *process) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// kill ends the process with SIGKILL and waits for it.
func (p *process) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// poll calls cond until it holds, failing the test after waitFor.
func poll(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond) // polling interval, not synchronisation
	}
}

// collector gathers what the sender publishes.
type collector struct {
	mu      sync.Mutex
	results []contract.TransferResult
	waiters map[string]chan contract.TransferResult // by task id (await)
	dlq     []contract.DeadLetterNotice
	events  []contract.KVEventRecord
}

func (c *collector) handle(_ context.Context, m bus.Received) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var err error
	switch m.Topic {
	case contract.TopicTransferResults:
		var r contract.TransferResult
		if err = json.Unmarshal(m.Value, &r); err == nil {
			c.results = append(c.results, r)
			if w, ok := c.waiters[r.TaskID]; ok {
				w <- r
				delete(c.waiters, r.TaskID)
			}
		}
	case contract.TopicSaveDLQ:
		var d contract.DeadLetterNotice
		if err = json.Unmarshal(m.Value, &d); err == nil {
			c.dlq = append(c.dlq, d)
		}
	case contract.TopicKVEvents:
		var e contract.KVEventRecord
		if e, err = contract.DecodeKVEventRecord(m.Value, m.Headers); err == nil {
			c.events = append(c.events, e)
		}
	}
	return err
}

// await returns a channel that gets the next TransferResult of taskID
// collected from now on.
func (c *collector) await(taskID string) <-chan contract.TransferResult {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.waiters == nil {
		c.waiters = map[string]chan contract.TransferResult{}
	}
	w := make(chan contract.TransferResult, 1)
	c.waiters[taskID] = w
	return w
}

// result waits for the TransferResult of taskID.
func (c *collector) result(t testing.TB, taskID string) contract.TransferResult {
	t.Helper()
	var out contract.TransferResult
	poll(t, "the transfer result of "+taskID, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, r := range c.results {
			if r.TaskID == taskID {
				out = r
				return true
			}
		}
		return false
	})
	return out
}

// storedEvent is what the BlockStored records of one request's group
// announce together (one record per store namespace).
type storedEvent struct {
	Kind  contract.KVEventKind
	Model string
	Keys  []string
}

// blockStored waits until the BlockStored records of one request's group
// name at least want keys, and returns them together, in record order.
func (c *collector) blockStored(t testing.TB, requestID string, group, want int) storedEvent {
	t.Helper()
	var out storedEvent
	poll(t, "the kv events of "+requestID, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		out = storedEvent{}
		for _, e := range c.events {
			if e.RequestID == requestID && e.Kind() == contract.BlockStored && *e.Batch.Events[0].GroupIdx == group {
				out.Kind, out.Model = e.Kind(), e.Model
				out.Keys = append(out.Keys, e.Keys()...)
			}
		}
		return len(out.Keys) >= max(want, 1)
	})
	return out
}

// deadLetters waits for n DLQ records of taskID.
func (c *collector) deadLetters(t testing.TB, taskID string, n int) []contract.DeadLetterNotice {
	t.Helper()
	var out []contract.DeadLetterNotice
	poll(t, fmt.Sprintf("%d dlq records of %s", n, taskID), func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		out = out[:0]
		for _, d := range c.dlq {
			if d.TaskID == taskID {
				out = append(out, d)
			}
		}
		return len(out) >= n
	})
	return out
}

// stack is one test's running mesh part: broker, database, a gpuworker
// subprocess per engine and the sender in process.
type stack struct {
	env       *servicetest.Env
	model     *kvcore.Model
	prefix    string
	db        *pgxpool.Pool
	producer  *bus.Producer
	got       *collector
	sender    string // HTTP address
	workers   map[string]*dataplane.Client
	procs     map[string]*process // each engine's gpuworker subprocess
	redis     string              // the store both use unless a test says otherwise
	store     kvstore.Store
	written   map[string][]byte // "engine/group/block" → bytes written into the pool
	noWrites  bool              // task() leaves the pool as it is
	modelSpec string            // KVMESH_MODEL of both services
	pool      int               // KVMESH_POOL_BLOCKS of the workers
	// workerExtra overrides or adds settings of the workers' environment.
	workerExtra map[string]string
	mu          sync.Mutex
}

type stackOptions struct {
	senderRedis string // default: the shared Redis
	workerRedis string // default: the shared Redis
	engines     []string
	config      func(*app.Config)
	noSender    bool   // the test runs the sender itself
	modelFile   string // a model spec file for both services (default hybrid-mla-linear)
	poolBlocks  int    // blocks per group of each worker's pool (default 64)
	// workerEnv overrides or adds settings of every worker's environment.
	workerEnv map[string]string
}

func newStack(t testing.TB, o stackOptions) *stack {
	t.Helper()
	env := servicetest.NewEnv(t)
	modelSpec := "hybrid-mla-linear"
	if o.modelFile != "" {
		modelSpec = o.modelFile
	}
	m, err := service.LoadModel(modelSpec)
	if err != nil {
		t.Fatal(err)
	}
	s := &stack{env: env, model: m, modelSpec: modelSpec, prefix: "t" + randHex(6), redis: env.RedisURL, got: &collector{},
		workers: map[string]*dataplane.Client{}, procs: map[string]*process{}, written: map[string][]byte{}, pool: 64}
	if o.poolBlocks > 0 {
		s.pool = o.poolBlocks
	}
	s.workerExtra = o.workerEnv
	if o.workerRedis != "" {
		s.redis = o.workerRedis
	}
	if s.db, err = database.Connect(context.Background(), env.DatabaseURL); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.db.Close)
	if s.store, err = kvstore.NewRedis(context.Background(), s.redis, kvstore.RedisOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.store.Close() })
	if s.producer, err = bus.NewProducer(env.Brokers); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.producer.Close() })
	s.startCollector(t)
	for _, e := range o.engines {
		s.startWorker(t, e)
	}
	senderRedis := o.senderRedis
	if senderRedis == "" {
		senderRedis = s.redis
	}
	if !o.noSender {
		s.sender = s.startSender(t, senderRedis, o.config)
	}
	return s
}

func (s *stack) startCollector(t testing.TB) {
	c, err := bus.NewConsumer(bus.ConsumerConfig{
		Brokers: s.env.Brokers, GroupID: "test-collector-" + randHex(4),
		Topics:       []string{contract.TopicTransferResults, contract.TopicSaveDLQ, contract.TopicKVEvents},
		OnDeadLetter: func(context.Context, bus.Received, kvcore.Reason, error) error { return nil },
		Logger:       slog.New(slog.DiscardHandler), SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond,
	}, s.got.handle)
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, c.Run)
}

// senderConfig is the sender's configuration for tests.
func (s *stack) senderConfig(redisURL string) app.Config {
	common := s.env.Common()
	common.KeyPrefix, common.SessionTimeout = s.prefix, time.Second
	return app.Config{
		Common: common, HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Database: service.Database{DatabaseURL: s.env.DatabaseURL}, Store: service.Store{RedisURL: redisURL},
		Consumers: 1, Concurrency: 4,
		RetryAttempts: 3, RetryBase: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		ProbeEvery: 2, PressureCoolDown: time.Hour, Workers: service.Workers{WorkerStaleAfter: 30 * time.Second},
		// The store timeout is the service's default (5 s): a test machine
		// busy with other packages has made a Redis round trip take over a
		// second; a store that is down refuses at once either way.
		StoreTimeout: sending.DefaultStoreTimeout, PutTimeout: 10 * time.Second,
	}
}

func (s *stack) startSender(t testing.TB, redisURL string, mod func(*app.Config)) string {
	t.Helper()
	cfg := s.senderConfig(redisURL)
	cfg.Model = s.modelSpec
	if mod != nil {
		mod(&cfg)
	}
	a, err := app.New(context.Background(), cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, a.Run)
	servicetest.WaitReady(t, a.Addr())
	return a.Addr()
}

// testLogger keeps the service log and prints it when the test fails.
func testLogger(t testing.TB) *slog.Logger {
	var mu sync.Mutex
	var buf bytes.Buffer
	t.Cleanup(func() {
		if t.Failed() {
			mu.Lock()
			defer mu.Unlock()
			b := buf.Bytes()
			if len(b) > 8000 {
				b = b[len(b)-8000:]
			}
			t.Logf("sender log (tail):\n%s", b)
		}
	})
	return slog.New(slog.NewJSONHandler(lockedWriter{&mu, &buf}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// workerEnv is the environment of a gpuworker subprocess for engine.
func (s *stack) workerEnv(engine string) map[string]string {
	env := map[string]string{
		"KVMESH_AUTH":          "off", // these tests are about other things; the auth tests turn it on
		"KVMESH_KAFKA_BROKERS": strings.Join(s.env.Brokers, ","), "KVMESH_DATABASE_URL": s.env.DatabaseURL,
		"KVMESH_REDIS_URL": s.redis, "KVMESH_ENGINE_ID": engine, "KVMESH_HTTP_ADDR": "127.0.0.1:0",
		"KVMESH_MODEL": s.modelSpec, "KVMESH_POOL_BLOCKS": itoa(s.pool), "KVMESH_KEY_PREFIX": s.prefix,
		"KVMESH_KAFKA_PARTITIONS": "2", "KVMESH_KAFKA_SESSION_TIMEOUT": "1s", "KVMESH_LOG_LEVEL": "debug",
	}
	maps.Copy(env, s.workerExtra)
	return env
}

// startWorker runs the real gpuworker binary for engine and waits until it
// is registered and ready.
func (s *stack) startWorker(t testing.TB, engine string) *dataplane.Client {
	t.Helper()
	p := startProcess(t, testenv.BuildBinary(t, "./services/gpuworker"), s.workerEnv(engine))
	var addr string
	poll(t, "gpuworker "+engine+" registered", func() bool {
		ws, err := registry.Find(context.Background(), s.db, engine, time.Minute)
		if err == nil {
			addr = ws[0].Addr
		}
		return err == nil
	})
	servicetest.WaitReady(t, strings.TrimPrefix(addr, "http://"))
	hc := dataplane.DefaultHTTPClient()
	t.Cleanup(hc.CloseIdleConnections)
	c := dataplane.NewClient(addr, hc)
	s.mu.Lock()
	s.workers[engine] = c
	s.procs[engine] = p
	s.mu.Unlock()
	return c
}

// task builds a save task of tokens [start, end) for request id of engine,
// with block ids base+i in every group, and writes fresh random bytes
// into those pool blocks (when the engine has a worker).
func (s *stack) task(t testing.TB, engine, id string, start, end int, base kvcore.BlockID) *kvcore.SaveTask {
	t.Helper()
	return s.taskWithTokens(t, engine, id, tokensFor(s.prefix+id, end), start, end, base)
}

func tokensFor(seed string, n int) []uint32 {
	tokens := make([]uint32, n)
	h := uint32(2166136261)
	for _, c := range []byte(seed) {
		h = (h ^ uint32(c)) * 16777619
	}
	for i := range tokens {
		tokens[i] = h + uint32(i)
	}
	return tokens
}

func (s *stack) taskWithTokens(t testing.TB, engine, id string, tokens []uint32, start, end int, base kvcore.BlockID) *kvcore.SaveTask {
	t.Helper()
	m := s.model
	var hashes []string
	for _, h := range kvcore.HashChain(tokens[:end], m.HashBlockSize, nil) {
		hashes = append(hashes, h.Hex())
	}
	table := make(kvcore.BlockTable, len(m.Groups))
	for g := range table {
		for i := 0; i < end/m.Groups[g].BlockSize; i++ {
			table[g] = append(table[g], base+kvcore.BlockID(i))
		}
	}
	task := &kvcore.SaveTask{Schema: kvcore.SchemaSaveTask, TaskID: "task-" + id + "-" + randHex(3), EngineID: engine,
		RequestID: id, Model: m.Name, Start: start, End: end, BlockTable: table, BlockHashes: hashes,
		Groups: m.SaveGroups(start, end)}
	s.mu.Lock()
	_, hasWorker := s.workers[engine]
	s.mu.Unlock()
	if hasWorker && !s.noWrites {
		s.writeBlocks(t, task)
	}
	return task
}

// writeBlocks writes fresh random bytes into every block of the task's
// table in its engine's pool, each as the content of the chunk that block
// holds (the task's hash for it, written by the task's request), and
// remembers them for checkStored.
func (s *stack) writeBlocks(t testing.TB, task *kvcore.SaveTask) {
	t.Helper()
	var blocks []dataplane.Block
	for g, ids := range task.BlockTable {
		if g >= len(s.model.Groups) {
			continue // a malformed task's extra group: nothing to hold it
		}
		for i, b := range ids {
			if b < 0 {
				continue // a null block holds nothing
			}
			data := make([]byte, s.model.Groups[g].BytesPerBlock)
			_, _ = rand.Read(data)
			blocks = append(blocks, dataplane.Block{BlockRef: dataplane.BlockRef{Group: g, Block: b},
				Identity: dataplane.Identity{Hash: s.blockHash(task, g, i), RequestID: task.RequestID}, Data: data})
		}
	}
	s.mu.Lock()
	w := s.workers[task.EngineID]
	s.mu.Unlock()
	if err := w.Write(context.Background(), blocks); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range blocks {
		s.written[blockKey(task.EngineID, b.Group, b.Block)] = b.Data
	}
}

// blockHash is the hash of the chunk that the i-th block of group g of
// task holds: task.BlockHashes[chunk.HashIndex(model.HashBlockSize)] for
// the block's chunk [i×bs, (i+1)×bs). A block past the task's hashes (or
// with an empty one) gets a random hash: no chunk of the task uses it.
func (s *stack) blockHash(task *kvcore.SaveTask, g, i int) string {
	bs := s.model.Groups[g].BlockSize
	c := kvcore.Chunk{Start: i * bs, End: (i + 1) * bs}
	if hi := c.HashIndex(s.model.HashBlockSize); hi >= 0 && hi < len(task.BlockHashes) && task.BlockHashes[hi] != "" &&
		len(task.BlockHashes[hi]) <= dataplane.MaxHashLen {
		return task.BlockHashes[hi]
	}
	return randHex(32)
}

func blockKey(engine string, g int, b kvcore.BlockID) string {
	return fmt.Sprintf("%s/%d/%d", engine, g, b)
}

// publish sends tasks to kvmesh.save.tasks, keyed by request id.
func (s *stack) publish(t testing.TB, tasks ...*kvcore.SaveTask) {
	t.Helper()
	msgs := make([]bus.Message, len(tasks))
	for i, task := range tasks {
		msgs[i] = s.taskMessage(t, task)
	}
	s.publishRaw(t, msgs...)
}

// taskMessage is the save-task record of task, keyed by its request id.
func (s *stack) taskMessage(t testing.TB, task *kvcore.SaveTask) bus.Message {
	t.Helper()
	v, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	return bus.Message{Topic: contract.TopicSaveTasks, Key: task.RequestID, Value: v}
}

func (s *stack) publishRaw(t testing.TB, msgs ...bus.Message) {
	t.Helper()
	if err := s.producer.Publish(context.Background(), msgs...); err != nil {
		t.Fatal(err)
	}
}

// keys lists the store keys of one group of a task (rank 0), in chunk order.
func (s *stack) keys(t testing.TB, task *kvcore.SaveTask, g int) []string {
	t.Helper()
	items, err := kvcore.PlanSend(s.model, kvcore.KeysOf(s.model).WithPrefix(s.prefix), task, g, kvcore.Rank{})
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.Key
	}
	return out
}

// checkStored fails unless every key of group g of task holds, in the
// store, exactly the bytes written into its pool block.
func (s *stack) checkStored(t testing.TB, task *kvcore.SaveTask, g int) {
	t.Helper()
	s.checkStoredFrom(t, task, g, 0)
}

// checkStoredFrom is checkStored for the group's chunks from index from.
func (s *stack) checkStoredFrom(t testing.TB, task *kvcore.SaveTask, g, from int) {
	t.Helper()
	items, err := kvcore.PlanSend(s.model, kvcore.KeysOf(s.model).WithPrefix(s.prefix), task, g, kvcore.Rank{})
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range items[from:] {
		vals, errs, err := s.store.Get(context.Background(), []string{it.Key})
		if err != nil || errs[0] != nil {
			t.Fatalf("group %d key %s: %v %v", g, it.Key, err, errs)
		}
		payload, err := dataplane.DecodeValue(s.model.Fingerprint(), vals[0])
		if err != nil {
			t.Fatalf("group %d key %s: %v", g, it.Key, err)
		}
		s.mu.Lock()
		want := s.written[blockKey(task.EngineID, g, it.Block)]
		s.mu.Unlock()
		if !bytes.Equal(payload, want) {
			t.Fatalf("group %d block %d: the store holds other bytes than the pool's", g, it.Block)
		}
	}
}

// missing reports how many of keys are absent from the store.
func (s *stack) missing(t testing.TB, keys []string) int {
	t.Helper()
	found, err := s.store.Exists(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range found {
		if !f {
			n++
		}
	}
	return n
}

// do does an HTTP request to the sender and decodes the JSON answer
// (testenv.CallJSON).
func (s *stack) do(t testing.TB, method, path, token string, out any) int {
	t.Helper()
	return testenv.CallJSON(t, method, "http://"+s.sender+path, token, out)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func groupOf(r contract.TransferResult, g int) contract.GroupOutcome {
	for _, o := range r.Groups {
		if o.Group == g {
			return o
		}
	}
	return contract.GroupOutcome{Group: -1}
}

func itoa(i int) string { return strconv.Itoa(i) }

// redisFlush empties the Redis server at url.
func redisFlush(t testing.TB, url string) error {
	t.Helper()
	opts, err := redis.ParseURL(url)
	if err != nil {
		return err
	}
	c := redis.NewClient(opts)
	defer c.Close()
	return c.FlushAll(context.Background()).Err()
}

// checkMetrics fails unless the sender's /metrics has a line starting with
// each of want.
func (s *stack) checkMetrics(t testing.TB, want ...string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+s.sender+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	lines := strings.Split(string(body), "\n")
	for _, w := range want {
		found := false
		for _, l := range lines {
			found = found || strings.HasPrefix(l, w)
		}
		if !found {
			t.Errorf("/metrics has no line starting with %s", w)
		}
	}
}

// doBody does an HTTP request with a JSON body (none when empty) to the
// sender as the operator and decodes the JSON answer unless out is nil.
func (s *stack) doBody(t testing.TB, method, path, body string, out any) int {
	t.Helper()
	return testenv.CallJSONBody(t, method, "http://"+s.sender+path, adminToken, body, out)
}

// removals returns the BlockRemoved records collected so far.
func (c *collector) removals() []contract.KVEventRecord {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []contract.KVEventRecord
	for _, e := range c.events {
		if e.Kind() == contract.BlockRemoved {
			out = append(out, e)
		}
	}
	return out
}

// removedBlocks counts the blocks of tenant announced removed for cause.
func (c *collector) removedBlocks(tenant, cause string) int {
	n := 0
	for _, r := range c.removals() {
		if r.Tenant == tenant && r.Cause == cause {
			n += len(r.Hashes)
		}
	}
	return n
}

// awaitWatcher waits until the sender's removal watcher announces the
// removal of probe keys spread over the store (on a cluster, over its
// masters): from then on it is subscribed everywhere.
func (s *stack) awaitWatcher(t testing.TB) {
	t.Helper()
	ns := kvcore.KeysOf(s.model).WithPrefix(s.prefix).ForTenant("probe").Namespace(kvcore.Rank{}, 0)
	var keys []string
	for i := range 16 {
		keys = append(keys, fmt.Sprintf("%s@%064x", ns, i+1))
	}
	poll(t, "the removal watcher subscribed", func() bool {
		items := make([]kvstore.Item, len(keys))
		for i, k := range keys {
			items[i] = kvstore.Item{Key: k, Value: []byte("probe")}
		}
		if _, err := s.store.Put(context.Background(), items); err != nil {
			t.Fatal(err)
		}
		if _, err := s.store.Remove(context.Background(), keys); err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, r := range s.got.removals() {
			if r.Tenant == "probe" {
				for _, h := range r.Hashes {
					seen[h] = true
				}
			}
		}
		return len(seen) == len(keys)
	})
}
