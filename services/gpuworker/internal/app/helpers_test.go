package app_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
)

// waitFor bounds every poll in these tests.
const waitFor = 30 * time.Second

// worker is one running gpuworker under test.
type worker struct {
	app    *app.App
	cfg    app.Config
	model  *kvcore.Model
	keys   kvcore.KeyBuilder
	client *dataplane.Client
	// addr is the worker's HTTP address (host:port).
	addr string
}

// testConfig is a worker configuration for env with a small pool and a
// per-test key prefix, so tests sharing the Redis server never collide.
func testConfig(env *servicetest.Env, engine string) app.Config {
	common := env.Common()
	common.KeyPrefix = "t" + randomHex(6)
	common.SessionTimeout = 10 * time.Second
	return app.Config{
		Common:            common,
		HTTP:              service.HTTP{HTTPAddr: "127.0.0.1:0"},
		Database:          service.Database{DatabaseURL: env.DatabaseURL},
		Store:             service.Store{RedisURL: env.RedisURL},
		EngineID:          engine,
		PoolBlocks:        16,
		MaxBatchBytes:     4 << 20,
		HeartbeatInterval: 200 * time.Millisecond,
		Workers:           service.Workers{WorkerStaleAfter: 10 * time.Second},
	}
}

// startWorker starts a gpuworker with cfg (and an NVML source, nil for the
// machine's) and waits until it is ready.
func startWorker(t testing.TB, cfg app.Config, gpus *devices.Source) *worker {
	t.Helper()
	return startWorkerLogging(t, cfg, gpus, slog.New(slog.DiscardHandler))
}

// startWorkerLogging is startWorker with the worker logging to log.
func startWorkerLogging(t testing.TB, cfg app.Config, gpus *devices.Source, log *slog.Logger) *worker {
	t.Helper()
	if gpus == nil {
		gpus = devices.NewSystemSource()
	}
	a, err := app.NewWithDevices(context.Background(), cfg, log, gpus)
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, a.Run)
	servicetest.WaitReady(t, a.Addr())
	m, err := service.LoadModel(cfg.Model)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := kvcore.NewKeyBuilder(cfg.KeyPrefix, m)
	if err != nil {
		t.Fatal(err)
	}
	cleanPrefix(t, cfg.RedisURL, cfg.KeyPrefix)
	return &worker{app: a, cfg: cfg, model: m, keys: kb, client: dataplane.NewClient("http://"+a.Addr(), nil), addr: a.Addr()}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// randomBlock is bytes_per_block random bytes of group g.
func (w *worker) randomBlock(g int) []byte {
	b := make([]byte, w.model.Groups[g].BytesPerBlock)
	_, _ = rand.Read(b)
	return b
}

// readBlock reads one pool block through the data plane, asking for hash;
// a refusal fails the test.
func (w *worker) readBlock(t *testing.T, g int, b kvcore.BlockID, hash string) []byte {
	t.Helper()
	got, err := w.client.Read(context.Background(), []dataplane.ReadRef{{BlockRef: dataplane.BlockRef{Group: g, Block: b}, Hash: hash}})
	if err != nil {
		t.Fatal(err)
	}
	if got[0].NotHeld != "" {
		t.Fatalf("group %d block %d refused: %s", g, b, got[0].NotHeld)
	}
	return got[0].Data
}

// redisClient opens a go-redis client for url, closed at cleanup.
func redisClient(t testing.TB, url string) *redis.Client {
	t.Helper()
	o, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(o)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// cleanPrefix deletes every key under prefix when the test ends.
func cleanPrefix(t testing.TB, url, prefix string) {
	c := redisClient(t, url)
	t.Cleanup(func() {
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"@*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if len(keys) > 0 {
			_ = c.Del(ctx, keys...).Err() // best effort: the prefix is random
		}
	})
}

// results collects transfer results from the broker.
type results struct {
	mu   sync.Mutex
	seen []contract.TransferResult
	ch   chan struct{}
}

// watchResults consumes kvmesh.transfer.results from the start in a group
// of its own until the test ends.
func watchResults(t testing.TB, env *servicetest.Env) *results {
	t.Helper()
	rs := &results{ch: make(chan struct{}, 1)}
	c, err := bus.NewConsumer(bus.ConsumerConfig{
		Brokers: env.Brokers, GroupID: "test-results-" + randomHex(4),
		Topics:       []string{contract.TopicTransferResults},
		OnDeadLetter: func(context.Context, bus.Received, kvcore.Reason, error) error { return nil },
		Logger:       slog.New(slog.DiscardHandler),
	}, func(_ context.Context, m bus.Received) error {
		var r contract.TransferResult
		if err := json.Unmarshal(m.Value, &r); err != nil {
			return bus.Permanent(kvcore.ReasonUndecodable, err)
		}
		rs.mu.Lock()
		rs.seen = append(rs.seen, r)
		rs.mu.Unlock()
		select {
		case rs.ch <- struct{}{}:
		default:
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, c.Run)
	return rs
}

// find returns the results of a task.
func (rs *results) find(taskID string) []contract.TransferResult {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	var out []contract.TransferResult
	for _, r := range rs.seen {
		if r.TaskID == taskID {
			out = append(out, r)
		}
	}
	return out
}

// wait returns the first result of a task, failing the test after waitFor.
func (rs *results) wait(t testing.TB, taskID string) contract.TransferResult {
	t.Helper()
	deadline := time.After(waitFor)
	for {
		if got := rs.find(taskID); len(got) > 0 {
			return got[0]
		}
		select {
		case <-rs.ch:
		case <-time.After(100 * time.Millisecond):
		case <-deadline:
			t.Fatalf("no transfer result for task %s within %s", taskID, waitFor)
		}
	}
}

// publisher publishes load tasks to env's broker.
func publisher(t testing.TB, env *servicetest.Env) *bus.Producer {
	t.Helper()
	p, err := bus.NewProducer(env.Brokers)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// publishTask publishes a load task keyed by its engine id.
func publishTask(t testing.TB, p *bus.Producer, task *kvcore.LoadTask) {
	t.Helper()
	v, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(context.Background(), bus.Message{Topic: contract.TopicLoadTasks, Key: task.EngineID, Value: v}); err != nil {
		t.Fatal(err)
	}
}

// tokens returns n deterministic tokens starting at seed.
func tokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed + uint32(i)
	}
	return out
}

// hexChain is the hex hash chain of toks.
func hexChain(m *kvcore.Model, toks []uint32) []string {
	var out []string
	for _, h := range kvcore.HashChain(toks, m.HashBlockSize, nil) {
		out = append(out, h.Hex())
	}
	return out
}

// loadTask builds a store load of tokens [0, end) into table for w's engine.
func (w *worker) loadTask(hashes []string, end int, table kvcore.BlockTable) *kvcore.LoadTask {
	return &kvcore.LoadTask{
		Schema: kvcore.SchemaLoadTask, TaskID: "task-" + randomHex(6), EngineID: w.cfg.EngineID,
		RequestID: "req-" + randomHex(6), Model: w.model.Name, Connector: "store",
		Start: 0, End: end, BlockTable: table, BlockHashes: hashes,
		Groups: w.model.LoadGroups(0, end),
	}
}

// getJSON GETs url and decodes the JSON answer into v.
func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s %s", url, resp.Status, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v in %s", url, err, body)
	}
}
