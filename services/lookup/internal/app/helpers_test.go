package app_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

// Model specs of the scenarios (docs/architecture.md: bs 16, hash 16
// unless stated).
const (
	specDense = `name: test-model
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 1024}
`
	specFullMamba = `name: test-model
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 1024}
  - {kind: mamba, block_size: 16, bytes_per_block: 4096}
`
	specFullSWA = `name: test-model
hash_block_size: 8
groups:
  - {kind: full_attention, block_size: 32, bytes_per_block: 1024}
  - {kind: sliding_window, block_size: 8, window: 8, bytes_per_block: 256}
`
)

// writeSpec writes a model spec into the test's temp dir and returns its path.
func writeSpec(t *testing.T, spec string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "model.yaml")
	if err := os.WriteFile(path, []byte(spec), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// randomID returns a fresh id, unique across tests sharing the Redis server.
func randomID(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// lookupService is a running lookup app and what its test needs to drive it.
type lookupService struct {
	addr   string
	prefix string
	model  *kvcore.Model
	kvZMQ  string // the KV-event publisher's PUB address; "" when off
	// kvReplay is its ROUTER replay address; "" without one.
	kvReplay string
}

// startLookup loads a Config from env-style variables (so defaults apply
// exactly as in production) on top of the env's broker and Redis, with a
// unique key prefix, starts the app and waits until it is ready.
func startLookup(t *testing.T, env *servicetest.Env, vars map[string]string) *lookupService {
	t.Helper()
	return startLookupLog(t, env, vars, slog.New(slog.DiscardHandler))
}

// startLookupLog is startLookup with the service logging to log.
func startLookupLog(t *testing.T, env *servicetest.Env, vars map[string]string, log *slog.Logger) *lookupService {
	t.Helper()
	all := map[string]string{
		"KVMESH_AUTH":             "off",
		"KVMESH_KAFKA_BROKERS":    strings.Join(env.Brokers, ","),
		"KVMESH_KAFKA_PARTITIONS": "2",
		"KVMESH_REDIS_URL":        env.RedisURL,
		"KVMESH_HTTP_ADDR":        "127.0.0.1:0",
		"KVMESH_KEY_PREFIX":       randomID("lookuptest-"),
		"KVMESH_SHUTDOWN_TIMEOUT": "2s",
	}
	for k, v := range vars {
		all[k] = v
	}
	var cfg app.Config
	if err := config.Load(&cfg, func(k string) (string, bool) { v, ok := all[k]; return v, ok }); err != nil {
		t.Fatalf("config: %v", err)
	}
	a, err := app.New(context.Background(), cfg, log)
	if err != nil {
		t.Fatalf("app.New: %v", err)
	}
	servicetest.Start(t, a.Run)
	servicetest.WaitReady(t, a.Addr())
	m, err := loadModel(cfg.Model)
	if err != nil {
		t.Fatal(err)
	}
	return &lookupService{addr: a.Addr(), prefix: cfg.KeyPrefix, model: m, kvZMQ: a.KVEventsZMQAddr(), kvReplay: a.KVEventsZMQReplayAddr()}
}

func loadModel(spec string) (*kvcore.Model, error) {
	if m, err := kvcore.Preset(spec); err == nil {
		return m, nil
	}
	data, err := os.ReadFile(spec)
	if err != nil {
		return nil, err
	}
	return kvcore.ParseModel(data)
}

// keys returns the builder of the service's store keys.
func (s *lookupService) keys() kvcore.KeyBuilder {
	return kvcore.KeysOf(s.model).WithPrefix(s.prefix)
}

// response is one HTTP answer.
type response struct {
	status int
	header http.Header
	body   []byte
}

// post sends body (a string is sent as is, anything else as JSON) to
// /v1/lookup with extra headers.
func (s *lookupService) post(t *testing.T, body any, headers map[string]string) response {
	t.Helper()
	return s.postTo(t, "/v1/lookup", body, headers)
}

// postTo is post to the route at path.
func (s *lookupService) postTo(t *testing.T, path string, body any, headers map[string]string) response {
	t.Helper()
	raw, ok := body.(string)
	if !ok {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		raw = string(b)
	}
	req, err := http.NewRequest(http.MethodPost, "http://"+s.addr+path, strings.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return response{status: resp.StatusCode, header: resp.Header, body: b}
}

// lookup posts body and decodes a 200 answer.
func (s *lookupService) lookup(t *testing.T, body any) contract.LookupDecision {
	t.Helper()
	return decodeDecision(t, s.post(t, body, nil))
}

// decodeDecision decodes a 200 answer strictly.
func decodeDecision(t *testing.T, res response) contract.LookupDecision {
	t.Helper()
	if res.status != http.StatusOK {
		t.Fatalf("lookup: status %d: %s", res.status, res.body)
	}
	if ct := res.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("Content-Type %q, want application/json", ct)
	}
	var d contract.LookupDecision
	dec := json.NewDecoder(bytes.NewReader(res.body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("decode answer %s: %v", res.body, err)
	}
	return d
}

var errInvalidTraceparent = errors.New("invalid traceparent")

// eventually polls cond every 10 ms until it holds, failing after 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for ; time.Now().Before(deadline); <-tick.C {
		if cond() {
			return
		}
	}
	t.Fatalf("%s: not within 10 s", what)
}

// problem decodes a problem+json answer with the wanted status.
func (r response) problem(t *testing.T, status int) httpserver.Problem {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d: %s", r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != httpserver.ContentTypeProblem {
		t.Fatalf("Content-Type %q, want %s", ct, httpserver.ContentTypeProblem)
	}
	var p httpserver.Problem
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("decode problem %s: %v", r.body, err)
	}
	return p
}

// metric scrapes /metrics and returns the value of series, written as the
// exposition format writes it (e.g. `x_total{op="a"}`); 0 when absent.
func (s *lookupService) metric(t *testing.T, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + s.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if ok && name == series {
			v, err := strconv.ParseFloat(value, 64)
			if err != nil {
				t.Fatalf("metric %s: %v", series, err)
			}
			return v
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return 0
}

// Series of the lookup's store metrics.
const (
	existsCalls = `kvmesh_store_op_duration_seconds_count{op="lookup_exists"}`
	existsKeys  = `kvmesh_store_keys_total{op="lookup_exists"}`
)

// tokens returns n deterministic token ids that differ by seed.
func tokens(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*1_000_003 + uint32(i)*31
	}
	return out
}

// seeder writes keys to the real Redis and removes them when the test ends.
type seeder struct {
	store *kvstore.Redis
	mu    sync.Mutex
	keys  []string
}

func newSeeder(t *testing.T, url string) *seeder {
	t.Helper()
	st, err := kvstore.NewRedis(context.Background(), url, kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s := &seeder{store: st}
	t.Cleanup(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if len(s.keys) > 0 {
			if _, err := st.Remove(context.Background(), s.keys); err != nil {
				t.Errorf("clean up seeded keys: %v", err)
			}
		}
		_ = st.Close()
	})
	return s
}

// put stores each key with a small value.
func (s *seeder) put(t *testing.T, keys ...string) {
	t.Helper()
	items := make([]kvstore.Item, len(keys))
	for i, k := range keys {
		items[i] = kvstore.Item{Key: k, Value: []byte("kv")}
	}
	errs, err := s.store.Put(context.Background(), items)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range errs {
		if e != nil {
			t.Fatalf("put %s: %v", keys[i], e)
		}
	}
	s.mu.Lock()
	s.keys = append(s.keys, keys...)
	s.mu.Unlock()
}

// forget stops tracking the seeded keys: their server goes away with them.
func (s *seeder) forget() {
	s.mu.Lock()
	s.keys = nil
	s.mu.Unlock()
}

// remove deletes keys.
func (s *seeder) remove(t *testing.T, keys ...string) {
	t.Helper()
	if _, err := s.store.Remove(context.Background(), keys); err != nil {
		t.Fatal(err)
	}
}

// groupKeys returns group g's rank-0 keys of the hashes at indices idx.
func groupKeys(kb kvcore.KeyBuilder, g int, hashes []kvcore.BlockHash, idx ...int) []string {
	out := make([]string, len(idx))
	for i, j := range idx {
		out[i] = kb.Key(kvcore.Rank{}, g, hashes[j])
	}
	return out
}

// hexes is the hex form of a hash chain.
func hexes(hs []kvcore.BlockHash) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = h.Hex()
	}
	return out
}

// decisionLog reads kvmesh.lookup.decisions from the start, every
// partition, with real kafka-go readers.
type decisionLog struct {
	mu   sync.Mutex
	msgs []kafka.Message
}

// readDecisions starts readers on every partition of the decisions topic;
// they stop when the test ends.
func readDecisions(t *testing.T, brokers []string) *decisionLog {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	if err != nil {
		t.Fatal(err)
	}
	parts, err := conn.ReadPartitions(contract.TopicLookupDecisions)
	_ = conn.Close()
	if err != nil || len(parts) == 0 {
		t.Fatalf("partitions of %s: %v (%d)", contract.TopicLookupDecisions, err, len(parts))
	}
	log := &decisionLog{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, p := range parts {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: brokers, Topic: contract.TopicLookupDecisions, Partition: p.ID,
			MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 50 * time.Millisecond,
		})
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer r.Close()
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					return
				}
				log.mu.Lock()
				log.msgs = append(log.msgs, m)
				log.mu.Unlock()
			}
		}()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	return log
}

// await polls until a record keyed by requestID arrives and decodes it.
func (l *decisionLog) await(t *testing.T, requestID string) (contract.LookupDecision, kafka.Message) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for ; time.Now().Before(deadline); <-tick.C {
		if m, ok := l.find(requestID); ok {
			var d contract.LookupDecision
			dec := json.NewDecoder(bytes.NewReader(m.Value))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&d); err != nil {
				t.Fatalf("decision %s does not decode strictly: %v", m.Value, err)
			}
			return d, m
		}
	}
	t.Fatalf("no decision keyed %q on %s within 10 s", requestID, contract.TopicLookupDecisions)
	return contract.LookupDecision{}, kafka.Message{}
}

func (l *decisionLog) find(requestID string) (kafka.Message, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.msgs {
		if string(m.Key) == requestID {
			return m, true
		}
	}
	return kafka.Message{}, false
}

// header returns a record header's value.
func header(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
