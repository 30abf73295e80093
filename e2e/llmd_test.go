package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/go-zeromq/zmq4"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"github.com/redis/go-redis/v9"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/kvmesh/kvmesh/internal/llmdtest"
	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// llmdPod is the pod name kvmesh's ZMQ publisher announces the store as
// (the lookup's default), and the one the Kafka-fed index uses.
const llmdPod = "kvmesh-store"

// llmdIndex is llm-d's released indexer (llm-d-kv-cache v0.8.1), built
// as a router builds it: its token processor and in-memory block index,
// its longest-prefix scorer, its event pool with its vLLM adapter, and —
// for the ZMQ transport — its own subscriber. Every medium weighs 1, so a
// score is a count of blocks.
type llmdIndex struct {
	ix      *kvcache.Indexer
	tp      kvblock.TokenProcessor
	adapter *engineadapter.VLLMAdapter
	subs    *kvevents.SubscriberManager
	pool    *kvevents.Pool
}

// newLLMDIndex builds an index over blocks of blockSize tokens (the
// model's hash block size, llm-d's canonical block).
func newLLMDIndex(ctx context.Context, t *testing.T, blockSize int) *llmdIndex {
	t.Helper()
	ix, tp := llmdtest.NewIndexer(ctx, t, blockSize)
	return &llmdIndex{ix: ix, tp: tp, adapter: engineadapter.NewVLLMAdapter()}
}

// subscribe starts llm-d's pool and its ZMQ subscriber on endpoint, as its
// pod reconciler does for a vLLM pod (remote socket, topic filter "kv@").
func (l *llmdIndex) subscribe(ctx context.Context, t *testing.T, endpoint string) {
	t.Helper()
	// llm-d logs what its subscriber refuses or loses (an undecodable
	// message, a dropped connection) through controller-runtime's logger.
	// (Its refusals of events whose parent it never indexed are not
	// shown: a Mamba group's sparse blocks hang from blocks only the
	// other groups store, and are refused as llm-d refuses an engine's.)
	// Its goroutines may outlive the test by a moment (a subscriber's
	// receive on a closed socket): a line after the test ended is dropped,
	// as testing panics on a Log after completion.
	var mu sync.Mutex
	ended := false
	t.Cleanup(func() { mu.Lock(); ended = true; mu.Unlock() }) // runs after the shutdowns below
	ctx = log.IntoContext(ctx, funcr.New(func(prefix, args string) {
		if strings.Contains(args, "extra_features") ||
			!(strings.Contains(args, "parse") || strings.Contains(args, "onnect") || strings.Contains(args, "receive")) {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if !ended {
			t.Logf("llm-d: %s %s", prefix, args)
		}
	}, funcr.Options{Verbosity: 9}))
	l.pool = kvevents.NewPool(&kvevents.Config{Concurrency: 1}, l.ix.KVBlockIndex(), l.tp, l.adapter)
	l.pool.Start(ctx)
	l.subs = kvevents.NewSubscriberManager(l.pool)
	if err := l.subs.EnsureSubscriber(ctx, llmdPod, endpoint, "kv@", true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		l.subs.Shutdown(context.Background())
		l.pool.Shutdown(context.Background())
	})
}

// feed applies Kafka records through llm-d's own pool, as a Kafka
// transport in place of its ZMQ socket would, under the topic a vLLM pod of
// model would publish on; it returns how many records llm-d's adapter
// decoded and the first refusal. The pool is drained before it returns.
func (l *llmdIndex) feed(ctx context.Context, model string, recs []sim.Record) (decoded int, firstErr error) {
	topic := "kv@" + llmdPod + "@" + model
	pool := kvevents.NewPool(&kvevents.Config{Concurrency: 1}, l.ix.KVBlockIndex(), l.tp, l.adapter)
	pool.Start(ctx)
	for i, rec := range recs {
		msg := &kvevents.RawMessage{Topic: topic, Sequence: uint64(i), Payload: rec.Value}
		if _, _, _, err := l.adapter.ParseMessage(msg); err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("record %d/%d: %w", rec.Partition, rec.Offset, err)
			}
			continue
		}
		decoded++
		pool.AddTask(msg)
	}
	pool.Shutdown(ctx) // drains the queue
	return decoded, firstErr
}

// score is llm-d's score of the store for tokens, in tokens (blocks ×
// block size).
func (l *llmdIndex) score(ctx context.Context, t *testing.T, model string, tokens []uint32) int {
	t.Helper()
	scores, err := l.ix.ScoreTokens(ctx, tokens, model, []string{llmdPod}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return int(scores[llmdPod]) * l.tp.BlockSize()
}

// kvmeshScore asks the lookup's POST /v1/score for the store's score of
// tokens hashed with salt, with the operator credential.
func kvmeshScore(ctx context.Context, t *testing.T, s *stack, model, salt string, tokens []uint32) adminapi.TierScore {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": model, "token_ids": tokens, "extra": salt})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url("lookup")+"/v1/score", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out adminapi.ScoreResponse
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /v1/score: %s", resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out.Store
}

// checkSeqs: the publisher numbers its batches as a vLLM pod does, one
// more each, so a subscriber that sees a gap knows it lost one.
func checkSeqs(t *testing.T, seqs []uint64) {
	t.Helper()
	if len(seqs) == 0 {
		t.Fatal("a plain ZMQ subscriber received nothing from the publisher")
	}
	for i := 1; i < len(seqs); i++ {
		if seqs[i] != seqs[i-1]+1 {
			t.Fatalf("publisher seqs %v: %d follows %d", seqs, seqs[i], seqs[i-1])
		}
	}
	t.Logf("a plain ZMQ subscriber received seqs %d to %d, none missing", seqs[0], seqs[len(seqs)-1])
}

// rawSub subscribes a plain ZMQ SUB to endpoint and records the seq of
// every message; the returned func lists them.
func rawSub(ctx context.Context, t *testing.T, endpoint string) func() []uint64 {
	sub := zmq4.NewSub(ctx)
	if err := sub.Dial(endpoint); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seqs []uint64
	go func() {
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			if len(m.Frames) == 3 && len(m.Frames[1]) == 8 {
				mu.Lock()
				seqs = append(seqs, binary.BigEndian.Uint64(m.Frames[1]))
				mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { _ = sub.Close() })
	return func() []uint64 { mu.Lock(); defer mu.Unlock(); return slices.Clone(seqs) }
}

// freeTCPAddr returns a loopback address no one listens on now.
func freeTCPAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// llmdCase is one run of TestLLMDIndexesTheStore.
type llmdCase struct {
	name, model string
	// senderForm is the mesh's KVMESH_KV_EVENTS_FORM: the form of
	// the Kafka records llm-d reads directly.
	senderForm string
	// hybrid: llm-d folds the model's groups into one key, so its score is
	// the any-group prefix, not kvmesh's hit.
	hybrid bool
	// folds: the run must show a prompt where the folded count exceeds
	// kvmesh's hit (the hybrid TP1 run does; the seed's shorter run holds
	// every group's blocks to the same length, so there only the equality
	// with kvmesh's any-group prefix is checked).
	folds bool
	// seed runs the seed's own deployment and workload: TP8 MLA + linear
	// attention, the pd,store chain, seedRequests requests of the seed
	// preset; otherwise a TP1 stack with the store chain runs
	// smallWorkload.
	seed bool
}

// seedRequests is the length of the seed run llm-d indexes.
const seedRequests = 30

// TestLLMDIndexesTheStore drives llm-d's released indexer from a real mesh
// run, over both transports: the Kafka records applied through llm-d's
// own pool and vLLM adapter, and the lookup's ZMQ publisher read by
// llm-d's own subscriber. Every record in vLLM's positional form decodes;
// llm-d's score of the store equals kvmesh's hit on every prompt of a
// dense model and, on a hybrid one, the prefix of blocks some group holds
// (kvmesh's any_group_prefix_tokens) — the difference from kvmesh's hit is
// exactly what llm-d cannot see; a Redis DEL reaches both indexes.
func TestLLMDIndexesTheStore(t *testing.T) {
	for _, tc := range []llmdCase{
		{name: "dense", model: "dense", senderForm: "array"},
		{name: "hybrid", model: "full-swa-mamba", senderForm: "map", hybrid: true, folds: true},
		{name: "seed-tp8", model: tp8Model, senderForm: "array", hybrid: true, seed: true},
	} {
		t.Run(tc.name, func(t *testing.T) { testLLMD(t, tc) })
	}
}

func testLLMD(t *testing.T, tc llmdCase) {
	zmqAddr := freeTCPAddr(t)
	o := stackOptions{model: tc.model, connectors: "store", poolBlocks: 96, env: []string{
		"KVMESH_KV_EVENTS_FORM=" + tc.senderForm,
		"KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT=tcp://" + zmqAddr,
		"KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM=array",
	}}
	if tc.seed {
		o.connectors, o.poolBlocks = "pd,store", 192
	}
	s := newStack(t, o)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	m, err := kvcore.Preset(tc.model)
	if err != nil {
		t.Fatal(err)
	}
	viaZMQ := newLLMDIndex(ctx, t, m.HashBlockSize)
	viaZMQ.subscribe(ctx, t, "tcp://"+zmqAddr)
	seqs := rawSub(ctx, t, "tcp://"+zmqAddr)
	awaitLLMDSubscribed(ctx, t, s, m, contract.KVEventForm(tc.senderForm), viaZMQ)

	cfg := llmdRunConfig(t, s, tc)
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)

	recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicKVEvents)
	if err != nil {
		t.Fatal(err)
	}
	viaKafka := newLLMDIndex(ctx, t, m.HashBlockSize)
	decoded, firstErr := viaKafka.feed(ctx, m.Name, recs)
	t.Logf("llm-d decoded %d of %d Kafka records in the %s form (first refusal: %v)", decoded, len(recs), tc.senderForm, firstErr)
	if tc.senderForm == "array" && decoded != len(recs) {
		t.Fatalf("llm-d's adapter refused %d of %d records in the positional form: %v", len(recs)-decoded, len(recs), firstErr)
	}
	if tc.senderForm == "map" && decoded != 0 {
		t.Fatalf("llm-d v0.8.1 decoded %d map-form records; it reads only the positional form — update the docs", decoded)
	}
	prompts := runPrompts(t, cfg)
	transports := []llmdTransport{{"ZMQ (the lookup's publisher, array form)", viaZMQ}}
	if tc.senderForm == "array" {
		transports = append(transports, llmdTransport{"Kafka (the sender's records, array form)", viaKafka})
	}
	checkLLMDScores(ctx, t, s, tc, m, cfg.Salt, prompts, transports)
	held := func(outcome string) float64 {
		return metricValue(t, s.url("lookup"), `kvmesh_lookup_kv_events_zmq_held_total{outcome="`+outcome+`"}`)
	}
	t.Logf("ZMQ publisher: BlockStored events held for their parent: %v released, %v expired, %v dropped",
		held("released"), held("expired"), held("dropped"))
	checkSeqs(t, seqs())
	if !tc.hybrid {
		recs = checkLLMDRemoval(ctx, t, s, m, cfg.Salt, prompts, viaKafka, viaZMQ, recs)
		checkLLMDClear(ctx, t, s, m, prompts, viaKafka, viaZMQ, recs)
	}
}

// awaitLLMDSubscribed waits until llm-d's ZMQ subscription is live: a
// ZMQ PUB socket drops what it sends before a subscriber's subscription
// arrives (a vLLM pod's does too), so a probe BlockStored of a prompt no
// run sends is put on kvmesh.kv.events, in the sender's form, until the
// publisher's copy reaches llm-d's index.
func awaitLLMDSubscribed(ctx context.Context, t *testing.T, s *stack, m *kvcore.Model, form contract.KVEventForm, l *llmdIndex) {
	t.Helper()
	probe := make([]uint32, m.HashBlockSize)
	for i := range probe {
		probe[i] = uint32(4_000_000 + i) // past every simulated vocabulary
	}
	medium := contract.MediumStore
	kb := kvcore.KeysOf(m).WithPrefix(s.prefix)
	key, value, headers, err := contract.EncodeKVEventRecord(contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: 1, DataParallelRank: new(int), Events: []contract.KVEvent{{
			Kind: contract.BlockStored, BlockHashes: []uint64{0x9e0b}, TokenIDs: probe, BlockSize: m.HashBlockSize, Medium: &medium,
		}}},
		Model: m.Name, Namespace: kb.Namespace(m.Namespaces(0)[0], 0), Hashes: []string{"9e0b"},
	}, form)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := bus.NewProducer(s.brokers)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	// Two minutes, not eventually's 30 s: on a loaded 2-core CI machine the
	// lookup's consumer may take that long to join its group.
	subscribed := poll(ctx, 2*time.Minute, func() bool {
		msg := bus.Message{Topic: contract.TopicKVEvents, Key: key, Value: value, Headers: headers}
		if err := pub.Publish(ctx, msg); err != nil {
			t.Fatal(err)
		}
		return poll(ctx, time.Second, func() bool { return l.score(ctx, t, m.Name, probe) == m.HashBlockSize })
	})
	if !subscribed {
		t.Fatal("timed out waiting for llm-d's ZMQ subscription (a probe block indexed)")
	}
}

// llmdRunConfig is the simulator run of tc: the seed preset on the TP8
// stack, or smallWorkload.
func llmdRunConfig(t *testing.T, s *stack, tc llmdCase) sim.Config {
	t.Helper()
	if !tc.seed {
		return simConfig(t, s, false, smallWorkload(24, 0))
	}
	return seedConfig(t, s, seedRequests)
}

// runPrompts are the prompts of every turn of cfg's workload.
func runPrompts(t *testing.T, cfg sim.Config) [][]uint32 {
	t.Helper()
	convs, err := sim.Generate(cfg.Workload)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]uint32
	for _, c := range convs {
		for i := range c.Turns {
			out = append(out, c.Prompt(i))
		}
	}
	return out
}

// llmdTransport is one way llm-d's index was fed.
type llmdTransport struct {
	name  string
	index *llmdIndex
}

// checkLLMDScores compares, for every prompt, kvmesh's /v1/score with
// llm-d's score of the store on every transport that fed it (polled until
// a live subscriber caught up): llm-d counts the prefix of blocks some
// group holds, any_group_prefix_tokens. On a dense model that is kvmesh's
// hit, but for the full-hit rule (a prompt stored whole is loaded but for
// its last block, as vLLM's store connector does); on a hybrid model the
// hit can be shorter — the groups llm-d folds into one key.
func checkLLMDScores(ctx context.Context, t *testing.T, s *stack, tc llmdCase, m *kvcore.Model, salt string,
	prompts [][]uint32, transports []llmdTransport) {
	t.Helper()
	scores := make([]adminapi.TierScore, len(prompts))
	var n struct{ hits, equal, fullHit, groups int }
	var sample string
	for i, p := range prompts {
		sc := kvmeshScore(ctx, t, s, m.Name, salt, p)
		scores[i] = sc
		switch folded := sc.AnyGroupPrefixTokens; {
		case folded == 0:
			continue
		case folded == sc.HitTokens:
			n.equal++
		case folded == len(p) && sc.HitTokens == (len(p)-1)/m.SchedulerBlockSize()*m.SchedulerBlockSize():
			n.fullHit++
		default:
			n.groups++
			if sample == "" {
				sample = fmt.Sprintf("prompt %d (%d tokens): /v1/score hit %d, any-group prefix %d, groups %+v",
					i, len(p), sc.HitTokens, folded, sc.Groups)
			}
		}
		n.hits++
	}
	if n.hits == 0 {
		t.Fatalf("no prompt of the run hits the store; the comparison is empty")
	}
	for _, tr := range transports {
		var off []string
		ok := poll(ctx, 30*time.Second, func() bool {
			off = off[:0]
			for i, p := range prompts {
				if got := tr.index.score(ctx, t, m.Name, p); got != scores[i].AnyGroupPrefixTokens {
					off = append(off, fmt.Sprintf("prompt %d (%d tokens): llm-d %d, kvmesh %+v", i, len(p), got, scores[i]))
				}
			}
			return len(off) == 0
		})
		if !ok {
			t.Fatalf("llm-d fed over %s scores %d of %d prompts unlike kvmesh's any_group_prefix_tokens:\n%s",
				tr.name, len(off), len(prompts), strings.Join(off, "\n"))
		}
		t.Logf("%s: llm-d fed over %s scores all %d prompts as kvmesh's any_group_prefix_tokens", tc.name, tr.name, len(prompts))
	}
	t.Logf("%s: %d prompts, %d with a store hit; llm-d's score equals kvmesh's hit on %d, exceeds it by the full-hit rule on %d and by the groups it folds on %d; e.g. %s",
		tc.name, len(prompts), n.hits, n.equal, n.fullHit, n.groups, sample)
	if !tc.hybrid && n.groups != 0 {
		t.Fatalf("dense model: llm-d's count differs from kvmesh's hit on %d prompts beyond the full-hit rule", n.groups)
	}
	if tc.folds && n.groups == 0 {
		t.Fatalf("hybrid model: no prompt where llm-d's folded count exceeds kvmesh's hit; the run shows no group-aware difference")
	}
}

// checkLLMDRemoval deletes the second block of the prompt with the longest
// hit from Redis: the sender's watcher announces it, and both llm-d
// indexes (the new Kafka records applied, the ZMQ subscriber live) score
// the prompt one block, as kvmesh does.
func checkLLMDRemoval(ctx context.Context, t *testing.T, s *stack, m *kvcore.Model, salt string, prompts [][]uint32,
	viaKafka, viaZMQ *llmdIndex, before []sim.Record) []sim.Record {
	t.Helper()
	best, bestHit := -1, 0
	for i, p := range prompts {
		if h := kvmeshScore(ctx, t, s, m.Name, salt, p).HitTokens; h > bestHit && h >= 3*m.HashBlockSize {
			best, bestHit = i, h
		}
	}
	if best < 0 {
		t.Fatal("no prompt hits three blocks of the store")
	}
	chain := kvcore.HashChain(prompts[best], m.HashBlockSize, []byte(salt))
	kb := kvcore.KeysOf(m).WithPrefix(s.prefix)
	var keys []string
	for _, ns := range m.Namespaces(0) {
		keys = append(keys, kb.KeyHex(ns, 0, chain[1].Hex()))
	}
	rdb := redis.NewClient(mustParseRedis(t, s.redisURL))
	defer rdb.Close()
	if n, err := rdb.Del(ctx, keys...).Result(); err != nil || n == 0 {
		t.Fatalf("DEL %v: %d, %v", keys, n, err)
	}
	wantTokens := m.HashBlockSize
	if got := kvmeshScore(ctx, t, s, m.Name, salt, prompts[best]).HitTokens; got != wantTokens {
		t.Fatalf("kvmesh's hit after the DEL: %d tokens, want %d", got, wantTokens)
	}
	removed := newKVEvents(ctx, t, s, before, "the BlockRemoved of the deleted block", func(rec contract.KVEventRecord) bool {
		return rec.Kind() == contract.BlockRemoved && slices.Contains(rec.Hashes, chain[1].Hex())
	})
	if _, err := viaKafka.feed(ctx, m.Name, removed); err != nil {
		t.Fatal(err)
	}
	if got := viaKafka.score(ctx, t, m.Name, prompts[best]); got != wantTokens {
		t.Fatalf("llm-d (Kafka) scores %d tokens after the removal, want %d", got, wantTokens)
	}
	eventually(t, "llm-d's ZMQ-fed index to drop the removed block", func() bool {
		return viaZMQ.score(ctx, t, m.Name, prompts[best]) == wantTokens
	})
	t.Logf("removal: DEL of block 1 of prompt %d (hit %d → %d tokens) reached llm-d over Kafka and ZMQ", best, bestHit, wantTokens)
	return append(before, removed...)
}

// newKVEvents polls kvmesh.kv.events until a record not in before
// satisfies want, and returns the records not in before.
func newKVEvents(ctx context.Context, t *testing.T, s *stack, before []sim.Record, what string, want func(contract.KVEventRecord) bool) []sim.Record {
	t.Helper()
	seen := map[[2]int64]bool{}
	for _, r := range before {
		seen[[2]int64{int64(r.Partition), r.Offset}] = true
	}
	var fresh []sim.Record
	eventually(t, what+" on kvmesh.kv.events", func() bool {
		recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicKVEvents)
		if err != nil {
			return false
		}
		fresh = slices.DeleteFunc(recs, func(r sim.Record) bool { return seen[[2]int64{int64(r.Partition), r.Offset}] })
		return slices.ContainsFunc(fresh, func(r sim.Record) bool {
			rec, err := contract.DecodeKVEventRecord(r.Value, r.Headers)
			return err == nil && want(rec)
		})
	})
	return fresh
}

// checkLLMDClear has the sender's removal watcher announce a flush — its
// marker key renamed away, which it reads as a FLUSHALL (the shared test
// Redis cannot take a real one): the AllBlocksCleared record decodes in
// llm-d's adapter; llm-d v0.8.1 only logs it, so the Kafka-fed index keeps
// the store's blocks, while the lookup's publisher follows it with the
// removal of every block it announced and the ZMQ-fed index scores every
// prompt 0.
func checkLLMDClear(ctx context.Context, t *testing.T, s *stack, m *kvcore.Model, prompts [][]uint32,
	viaKafka, viaZMQ *llmdIndex, before []sim.Record) {
	t.Helper()
	rdb := redis.NewClient(mustParseRedis(t, s.redisURL))
	defer rdb.Close()
	marker := "kvmesh-evictions-marker@" + s.prefix + "@" + m.Name
	if err := rdb.Rename(ctx, marker, marker+"-renamed-by-test").Err(); err != nil {
		t.Fatalf("RENAME %s: %v", marker, err)
	}
	fresh := newKVEvents(ctx, t, s, before, "the AllBlocksCleared of the flush", func(rec contract.KVEventRecord) bool {
		return rec.Kind() == contract.AllBlocksCleared
	})
	decoded, err := viaKafka.feed(ctx, m.Name, fresh)
	if err != nil || decoded != len(fresh) {
		t.Fatalf("llm-d decoded %d of the %d records after the flush: %v", decoded, len(fresh), err)
	}
	kept := 0
	for _, p := range prompts {
		if viaKafka.score(ctx, t, m.Name, p) > 0 {
			kept++
		}
	}
	eventually(t, "llm-d's ZMQ-fed index to forget the flushed store", func() bool {
		for _, p := range prompts {
			if viaZMQ.score(ctx, t, m.Name, p) != 0 {
				return false
			}
		}
		return true
	})
	t.Logf("flush: AllBlocksCleared decoded by llm-d; fed from Kafka llm-d v0.8.1 ignores it (%d of %d prompts still scored); over the publisher (clear as removed) every prompt scores 0",
		kept, len(prompts))
}
