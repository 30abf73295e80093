package app_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/api"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// waitLimit bounds every wait of these tests.
const waitLimit = 30 * time.Second

// Model specs of the scenarios (docs/architecture.md: bs 16, hash 16
// unless stated).
const (
	// specFullMamba is the two-group hybrid of scenarios 4, 9 and 21.
	specFullMamba = `name: test-model
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 1024}
  - {kind: mamba, block_size: 16, bytes_per_block: 4096}
`
	// specFullSWA is scenario 5's full (bs 32) + sliding window (bs 8, window 8).
	specFullSWA = `name: test-model
hash_block_size: 8
groups:
  - {kind: full_attention, block_size: 32, bytes_per_block: 1024}
  - {kind: sliding_window, block_size: 8, window: 8, bytes_per_block: 256}
`
)

// outputs are the topics the scheduler publishes to.
var outputs = []string{contract.TopicSaveTasks, contract.TopicLoadTasks, contract.TopicEngineFeedback}

// randomID returns a fresh id.
func randomID(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// testLogger discards logs unless KVMESH_TEST_LOG=1.
func testLogger() *slog.Logger {
	if os.Getenv("KVMESH_TEST_LOG") == "1" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// eventually polls cond every 20 ms until it holds, failing after waitLimit.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", waitLimit, what)
		}
		<-tick.C
	}
}

// mesh is one test's broker, database and running scheduler, with a kafka-go
// writer standing in for engines, lookup, sender and gpuworkers, and a
// collector reading everything the scheduler publishes.
type mesh struct {
	t       testing.TB
	ctx     context.Context
	brokers []string
	dbURL   string
	pool    *pgxpool.Pool
	model   *kvcore.Model
	addr    string
	app     *app.App
	writer  *kafka.Writer
	out     *collector
}

// meshOptions tune a mesh.
type meshOptions struct {
	spec      string // model spec; default specFullMamba
	consumers int    // default 2
	config    func(*app.Config)
}

// newMesh starts a scheduler on a fresh servicetest env.
func newMesh(t testing.TB, o meshOptions) *mesh {
	t.Helper()
	env := servicetest.NewEnv(t)
	return startMesh(t, env.Brokers, env.DatabaseURL, o)
}

// startMesh starts a scheduler on the given broker and database.
func startMesh(t testing.TB, brokers []string, dbURL string, o meshOptions) *mesh {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if o.spec == "" {
		o.spec = specFullMamba
	}
	path := filepath.Join(t.TempDir(), "model.yaml")
	if err := os.WriteFile(path, []byte(o.spec), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := service.LoadModel(path)
	if err != nil {
		t.Fatal(err)
	}
	common := servicetest.Env{Brokers: brokers}
	cfg := app.Config{
		Common: common.Common(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Database: service.Database{DatabaseURL: dbURL}, Migrate: true, KVEventsTokenIDs: true,
		Consumers: max(o.consumers, 2), MaintenanceInterval: 100 * time.Millisecond,
	}
	cfg.Model = path
	cfg.LogLevel = "warn"
	if o.config != nil {
		o.config(&cfg)
	}
	a, err := app.New(ctx, cfg, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, a.Run)
	servicetest.WaitReady(t, a.Addr())
	pool, err := database.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	transport := &kafka.Transport{}
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Balancer: &kafka.Murmur2Balancer{}, BatchTimeout: 2 * time.Millisecond,
		RequiredAcks: kafka.RequireAll, Transport: transport}
	t.Cleanup(func() {
		_ = w.Close()
		transport.CloseIdleConnections()
	})
	return &mesh{t: t, ctx: ctx, brokers: brokers, dbURL: dbURL, pool: pool, model: m, addr: a.Addr(), app: a,
		writer: w, out: newCollector(t, brokers, outputs)}
}

// produce writes JSON values to topic, keyed by request id.
func (h *mesh) produce(topic string, items ...keyed) {
	h.t.Helper()
	msgs := make([]kafka.Message, len(items))
	for i, it := range items {
		b, err := json.Marshal(it.value)
		if err != nil {
			h.t.Fatal(err)
		}
		msgs[i] = kafka.Message{Topic: topic, Key: []byte(it.key), Value: b}
	}
	if err := h.writer.WriteMessages(h.ctx, msgs...); err != nil {
		h.t.Fatalf("produce to %s: %v", topic, err)
	}
}

// keyed is one value to produce with its key.
type keyed struct {
	key   string
	value any
}

// get fetches an admin API path into v and returns the status code.
func (h *mesh) get(path string, v any) int {
	h.t.Helper()
	resp, err := http.Get("http://" + h.addr + path)
	if err != nil {
		h.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Fatal(err)
	}
	if v != nil {
		if err := json.Unmarshal(body, v); err != nil {
			h.t.Fatalf("GET %s: %d %s: %v", path, resp.StatusCode, body, err)
		}
	}
	return resp.StatusCode
}

// outboxCount counts the outbox messages for topic whose value names the
// request (a feedback row is a batch of messages).
func (h *mesh) outboxCount(topic, requestID string) int {
	h.t.Helper()
	var n int
	// A feedback row is a batch: its messages are counted one by one.
	err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM outbox o CROSS JOIN LATERAL jsonb_array_elements(
		    CASE WHEN o.topic = $3 THEN convert_from(o.value, 'UTF8')::jsonb->'feedback'
		         ELSE jsonb_build_array(convert_from(o.value, 'UTF8')::jsonb) END) AS m
		WHERE o.topic = $1 AND m->>'request_id' = $2`, topic, requestID, contract.TopicEngineFeedback).Scan(&n)
	if err != nil {
		h.t.Fatal(err)
	}
	return n
}

// request drives one request of one engine.
type request struct {
	h      *mesh
	engine string
	id     string
	seq    int64
}

func (h *mesh) request(prefix string) *request {
	return &request{h: h, engine: randomID(prefix + "-e-"), id: randomID(prefix + "-r-")}
}

// hashes is a hash chain of n distinct hex hashes.
func hashes(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%064x", i+1)
	}
	return out
}

// fill is event without producing: it gives ev the request's identity and
// its next seq, in a step record of its engine with the model.
func (r *request) fill(ev contract.RequestEvent) contract.EngineStep {
	r.seq++
	ev.RequestID, ev.Seq = r.id, r.seq
	return contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: fmt.Sprintf("%s/%s/%d", r.engine, r.id, r.seq),
		EngineID: r.engine, Model: r.h.model.Name, Step: r.seq, Requests: []contract.RequestEvent{ev}}
}

// decision is decide without producing.
func (r *request) decision(id, chosen string, external int, children ...contract.ChildDecision) contract.LookupDecision {
	return contract.LookupDecision{
		Schema: contract.SchemaLookupDecision, DecisionID: id, EngineID: r.engine, RequestID: r.id,
		Model: r.h.model.Name, Chosen: chosen, ExternalTokens: external, LoadAsync: true, Children: children,
	}
}

// transferResult is result without producing: it gives res the request's
// identity and, unless set, a fresh result id.
func (r *request) transferResult(res contract.TransferResult) contract.TransferResult {
	res.Schema, res.EngineID, res.RequestID = contract.SchemaTransferResult, r.engine, r.id
	if res.ResultID == "" {
		res.ResultID = randomID("res-")
	}
	return res
}

// event fills ev's identity and seq, produces it in a step record of its
// own and returns the record.
func (r *request) event(ev contract.RequestEvent) contract.EngineStep {
	r.h.t.Helper()
	st := r.fill(ev)
	r.h.produce(contract.TopicEngineSteps, keyed{r.engine, st})
	return st
}

func (r *request) admit(prompt int) {
	r.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: prompt, BlockHashes: hashes(16)})
}

func (r *request) allocate(external int, table kvcore.BlockTable, decisionID string) {
	r.event(contract.RequestEvent{Kind: contract.EventAllocated, ExternalTokens: external, BlockTable: table, DecisionID: decisionID})
}

func (r *request) step(s kvcore.Step) {
	r.event(contract.RequestEvent{Kind: contract.EventScheduled, Step: &s})
}

func (r *request) finish() { r.event(contract.RequestEvent{Kind: contract.EventFinished}) }

func (r *request) preempt() { r.event(contract.RequestEvent{Kind: contract.EventPreempted}) }

// decide produces a lookup decision whose children are given in chain
// order; chosen is the chosen child's name ("" for none).
func (r *request) decide(id, chosen string, external int, children ...contract.ChildDecision) contract.LookupDecision {
	r.h.t.Helper()
	d := r.decision(id, chosen, external, children...)
	r.h.produce(contract.TopicLookupDecisions, keyed{r.id, d})
	return d
}

// storeChild is the store child's answer with a LoadSpec (nil spec: none).
func storeChild(tokens int, spec *kvcore.LoadSpec) contract.ChildDecision {
	return contract.ChildDecision{Name: "store", Tokens: tokens, Spec: spec}
}

// result produces a transfer result.
func (r *request) result(res contract.TransferResult) {
	r.h.produce(contract.TopicTransferResults, keyed{r.id, r.transferResult(res)})
}

// saved reports a save task stored in every group.
func (r *request) saved(task kvcore.SaveTask) {
	r.result(contract.TransferResult{Kind: contract.TransferSave, TaskID: task.TaskID, Status: string(kvcore.SaveStored)})
}

// detail fetches the request's admin view; ok is false on 404.
func (r *request) detail() (d api.Detail, ok bool) {
	r.h.t.Helper()
	code := r.h.get("/v1/requests/"+r.engine+"/"+r.id, &d)
	return d, code == http.StatusOK
}

// applied waits until the scheduler applied every event produced so far.
func (r *request) applied() api.Detail {
	r.h.t.Helper()
	var d api.Detail
	eventually(r.h.t, fmt.Sprintf("request %s to apply event %d", r.id, r.seq), func() bool {
		var ok bool
		d, ok = r.detail()
		return ok && d.LastSeq == r.seq
	})
	return d
}

// settled waits until the scheduler applied every event produced so far and
// the outbox published everything, then reads the topics to their ends: a
// task or feedback the scheduler emitted for the request is in the
// collector afterwards.
func (r *request) settled() api.Detail {
	r.h.t.Helper()
	d := r.applied()
	eventually(r.h.t, "outbox drained", func() bool {
		var n int
		err := r.h.pool.QueryRow(r.h.ctx, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&n)
		return err == nil && n == 0
	})
	r.h.out.sync(r.h.t)
	return d
}

func (r *request) saves() []kvcore.SaveTask { return r.h.out.saves(r.id) }

func (r *request) loads() []kvcore.LoadTask { return r.h.out.loads(r.id) }

func (r *request) feedback() []contract.EngineFeedback { return r.h.out.feedback(r.id) }

// waitSaves waits for n save tasks and returns them.
func (r *request) waitSaves(n int) []kvcore.SaveTask {
	r.h.t.Helper()
	eventually(r.h.t, fmt.Sprintf("%d save task(s) of %s", n, r.id), func() bool { return len(r.saves()) >= n })
	return r.saves()
}

// waitLoads waits for n load tasks and returns them.
func (r *request) waitLoads(n int) []kvcore.LoadTask {
	r.h.t.Helper()
	eventually(r.h.t, fmt.Sprintf("%d load task(s) of %s", n, r.id), func() bool { return len(r.loads()) >= n })
	return r.loads()
}

// waitFeedback waits for a feedback message of kind and returns it.
func (r *request) waitFeedback(kind kvcore.FeedbackKind) contract.EngineFeedback {
	r.h.t.Helper()
	var out contract.EngineFeedback
	eventually(r.h.t, fmt.Sprintf("%s feedback of %s", kind, r.id), func() bool {
		for _, f := range r.feedback() {
			if f.Kind == kind {
				out = f
				return true
			}
		}
		return false
	})
	return out
}

// table builds a two-group table: n blocks per group from first (group 1
// ids offset by 100).
func table(first, n int) kvcore.BlockTable {
	t := kvcore.BlockTable{{}, {}}
	for i := range n {
		t[0] = append(t[0], kvcore.BlockID(first+i))
		t[1] = append(t[1], kvcore.BlockID(100+first+i))
	}
	return t
}

// collector reads every partition of the output topics from the start and
// keeps the records.
type collector struct {
	t         testing.TB
	mu        sync.Mutex
	records   map[string][]received
	next      map[string][]int64 // per topic, per partition: next offset to read
	client    *kafka.Client
	transport *kafka.Transport
}

// received is one record read, with the time it was read and the ids its
// JSON value names (decoded once, when read).
type received struct {
	kafka.Message
	at                  time.Time
	engineID, requestID string
}

func newCollector(t testing.TB, brokers []string, topics []string) *collector {
	t.Helper()
	transport := &kafka.Transport{}
	c := &collector{t: t, records: map[string][]received{}, next: map[string][]int64{},
		client: &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport}, transport: transport}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	meta, err := c.client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		t.Fatal(err)
	}
	for _, tp := range meta.Topics {
		c.next[tp.Name] = make([]int64, len(tp.Partitions))
		for _, p := range tp.Partitions {
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: tp.Name, Partition: p.ID,
				StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 22, MaxWait: 20 * time.Millisecond})
			wg.Add(1)
			go func() {
				defer wg.Done()
				c.read(ctx, r)
			}()
		}
	}
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		transport.CloseIdleConnections()
	})
	return c
}

func (c *collector) read(ctx context.Context, r *kafka.Reader) {
	defer r.Close()
	for {
		m, err := r.ReadMessage(ctx)
		if err != nil {
			return
		}
		recs := c.split(m)
		c.mu.Lock()
		c.records[m.Topic] = append(c.records[m.Topic], recs...)
		c.next[m.Topic][m.Partition] = m.Offset + 1
		c.mu.Unlock()
	}
}

// split returns what the collector keeps of m: m itself, or, for an
// engine feedback record, one record per message it carries (its Value
// that message's encoding), so that tests read feedback message by
// message.
func (c *collector) split(m kafka.Message) []received {
	at := time.Now()
	vals := [][]byte{m.Value}
	if m.Topic == contract.TopicEngineFeedback {
		fs, err := contract.DecodeEngineFeedback(m.Value)
		if err != nil {
			c.t.Errorf("feedback record %s: %v", m.Value, err)
			return nil
		}
		vals = vals[:0]
		for _, f := range fs {
			v, err := json.Marshal(f)
			if err != nil {
				c.t.Errorf("feedback %+v: %v", f, err)
				return nil
			}
			vals = append(vals, v)
		}
	}
	out := make([]received, 0, len(vals))
	for _, v := range vals {
		rec := received{Message: m, at: at}
		rec.Value = v
		var ids struct {
			EngineID  string `json:"engine_id"`
			RequestID string `json:"request_id"`
		}
		if json.Unmarshal(v, &ids) == nil {
			rec.engineID, rec.requestID = ids.EngineID, ids.RequestID
		}
		out = append(out, rec)
	}
	return out
}

// sync waits until every partition was read up to its end as of the call.
func (c *collector) sync(t testing.TB) {
	t.Helper()
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{}}
	c.mu.Lock()
	for topic, parts := range c.next {
		for p := range parts {
			req.Topics[topic] = append(req.Topics[topic], kafka.LastOffsetOf(p))
		}
	}
	c.mu.Unlock()
	resp, err := c.client.ListOffsets(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the collector to read every partition to its end", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for topic, parts := range resp.Topics {
			for _, p := range parts {
				if p.Error != nil || c.next[topic][p.Partition] < p.LastOffset {
					return false
				}
			}
		}
		return true
	})
}

// values decodes the records of topic whose JSON names requestID.
func values[T any](c *collector, topic, requestID string) []T {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []T
	for _, m := range c.records[topic] {
		if m.requestID != requestID {
			continue
		}
		var v T
		if err := json.Unmarshal(m.Value, &v); err == nil {
			out = append(out, v)
		}
	}
	return out
}

// allValues decodes every record of topic.
func allValues[T any](c *collector, topic string) []T {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]T, 0, len(c.records[topic]))
	for _, m := range c.records[topic] {
		var v T
		if err := json.Unmarshal(m.Value, &v); err == nil {
			out = append(out, v)
		}
	}
	return out
}

func (c *collector) saves(requestID string) []kvcore.SaveTask {
	return values[kvcore.SaveTask](c, contract.TopicSaveTasks, requestID)
}

func (c *collector) loads(requestID string) []kvcore.LoadTask {
	return values[kvcore.LoadTask](c, contract.TopicLoadTasks, requestID)
}

func (c *collector) feedback(requestID string) []contract.EngineFeedback {
	return values[contract.EngineFeedback](c, contract.TopicEngineFeedback, requestID)
}

// keys returns the record keys of topic whose JSON names requestID.
func (c *collector) keys(topic, requestID string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, m := range c.records[topic] {
		if m.requestID == requestID {
			out = append(out, string(m.Key))
		}
	}
	return out
}

func jsonValue(v any) ([]byte, error) { return json.Marshal(v) }
