package tierevents

import (
	"context"
	"slices"
	"testing"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"

	"github.com/kvmesh/kvmesh/internal/llmdtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// llmdRouter is llm-d-kv-cache v0.8.1's own indexer (the router side of
// kvmesh.kv.events), with its in-memory index and a backend per tier.
type llmdRouter struct {
	ix         *kvcache.Indexer
	tp         kvblock.TokenProcessor
	pod, topic string
}

func newLLMDRouter(t *testing.T, blockSize int, model string) *llmdRouter {
	t.Helper()
	ix, tp := llmdtest.NewIndexer(t.Context(), t, blockSize)
	return &llmdRouter{ix: ix, tp: tp, pod: "kvmesh-store", topic: "kv@kvmesh-store@" + model}
}

// apply has llm-d's own adapter parse each record and its own pool apply
// them, in order; a record the adapter refuses fails the test.
func (r *llmdRouter) apply(t *testing.T, msgs []bus.Message) {
	t.Helper()
	adapter := engineadapter.NewVLLMAdapter()
	pool := kvevents.NewPool(&kvevents.Config{Concurrency: 1}, r.ix.KVBlockIndex(), r.tp, adapter)
	pool.Start(t.Context())
	for i, m := range msgs {
		raw := &kvevents.RawMessage{Topic: r.topic, Sequence: uint64(i), Payload: m.Value}
		if _, _, _, err := adapter.ParseMessage(raw); err != nil {
			t.Fatalf("llm-d refuses record %d: %v", i, err)
		}
		pool.AddTask(raw)
	}
	pool.Shutdown(context.Background()) // drains the queue
}

// tiers are the device tiers llm-d's index lists for each block of tokens.
func (r *llmdRouter) tiers(t *testing.T, tokens []uint32, model string) [][]string {
	t.Helper()
	keys, err := r.tp.TokensToKVBlockKeys(kvblock.EmptyBlockHash, tokens, model, nil)
	if err != nil {
		t.Fatal(err)
	}
	found, err := r.ix.KVBlockIndex().Lookup(t.Context(), keys, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := make([][]string, len(keys))
	for i, k := range keys {
		for _, e := range found[k] {
			if e.PodIdentifier == r.pod {
				out[i] = append(out[i], e.DeviceTier)
			}
		}
		slices.Sort(out[i])
	}
	return out
}

// TestLLMDIndexesTierBlocks: llm-d's released indexer, fed the sender's
// BlockStored of a prompt's blocks in Redis (medium CPU, with the tokens)
// and the gpuworkers' placeholder BlockStored of the same blocks in the
// capacity tier (medium STORAGE, no tokens) in the array form its adapter
// reads, lists every block under both tiers; after the sender's
// BlockRemoved of Redis's copies it still lists them under storage, and
// still scores the prompt's every block for the store's pod; the
// placeholders of medium CPU the gpuworker announces for blocks promoted
// back into Redis list those under cpu again.
func TestLLMDIndexesTierBlocks(t *testing.T) {
	t.Parallel()
	const blockSize, blocks, model = 16, 4, "llama"
	kb := kvcore.KeyBuilder{Model: model, Fingerprint: fp}
	tokens := make([]uint32, blockSize*blocks)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	var hashes []string
	var wire []uint64
	for i := range blocks {
		hashes = append(hashes, hashOf(i+1).Hex())
		wire = append(wire, contract.WireHash(hashOf(i+1)))
	}
	group, cpu := 0, contract.MediumStore
	redisEvents := func(kind contract.KVEventKind) bus.Message { // the sender's record
		e := contract.KVEvent{Kind: kind, BlockHashes: wire, Medium: &cpu, GroupIdx: &group}
		if kind == contract.BlockStored {
			e.TokenIDs, e.BlockSize = tokens, blockSize
		}
		m, err := bus.KVEventMessage(contract.KVEventRecord{
			Batch: contract.KVEventBatch{TS: 1, DataParallelRank: new(int), Events: []contract.KVEvent{e}},
			Model: model, Fingerprint: fp, Namespace: kb.Namespace(kvcore.Rank{}, group), Hashes: hashes,
		}, contract.KVEventFormArray)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}

	pub := &fakePublisher{}
	a := newAnnouncer(t, pub, Options{Form: contract.KVEventFormArray})
	for i := range blocks {
		a.Stored(kb.Key(kvcore.Rank{}, group, hashOf(i+1)))
	}
	a.drain()
	a.flush(t.Context(), true)

	r := newLLMDRouter(t, blockSize, model)
	r.apply(t, append([]bus.Message{redisEvents(contract.BlockStored)}, pub.messages()...))
	for i, got := range r.tiers(t, tokens, model) {
		if !slices.Equal(got, []string{"cpu", "storage"}) {
			t.Fatalf("block %d: llm-d lists tiers %v, want cpu and storage", i, got)
		}
	}

	r.apply(t, []bus.Message{redisEvents(contract.BlockRemoved)})
	for i, got := range r.tiers(t, tokens, model) {
		if !slices.Equal(got, []string{"storage"}) {
			t.Fatalf("block %d after Redis's removal: llm-d lists tiers %v, want storage alone", i, got)
		}
	}
	scores, err := r.ix.ScoreTokens(t.Context(), tokens, model, []string{r.pod}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := int(scores[r.pod]); got != blocks {
		t.Fatalf("llm-d scores %d blocks for the store after Redis's removal, want %d (the capacity tier's)", got, blocks)
	}

	// A load from the tier promotes two blocks back into Redis: their
	// placeholders of medium CPU put them back under cpu.
	pub.reset()
	a.Promoted([]string{kb.Key(kvcore.Rank{}, group, hashOf(1)), kb.Key(kvcore.Rank{}, group, hashOf(2))})
	a.drain()
	a.flush(t.Context(), true)
	r.apply(t, pub.messages())
	for i, got := range r.tiers(t, tokens, model) {
		want := []string{"storage"}
		if i < 2 {
			want = []string{"cpu", "storage"}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("block %d after the promotion of blocks 0 and 1: llm-d lists tiers %v, want %v", i, got, want)
		}
	}
}
