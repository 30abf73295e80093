package kvpublish

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"

	"github.com/kvmesh/kvmesh/internal/llmdtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// llmd is llm-d-kv-cache v0.8.1's own indexing path: an indexer over an
// in-memory index, its event pool with the vLLM adapter, and a subscriber
// manager.
type llmd struct {
	indexer *kvcache.Indexer
	pool    *kvevents.Pool
	subs    *kvevents.SubscriberManager
}

// newLLMD starts llm-d's pool and indexer; they stop at the test's end.
// The CPU tier weighs 1 (llm-d's default weighs it 0.8) so that a score
// counts the store's blocks.
func newLLMD(t *testing.T) *llmd {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	indexer, tp := llmdtest.NewIndexer(ctx, t, 0)
	pool := kvevents.NewPool(&kvevents.Config{Concurrency: 1}, indexer.KVBlockIndex(), tp, engineadapter.NewVLLMAdapter())
	pool.Start(ctx)
	subs := kvevents.NewSubscriberManager(pool)
	t.Cleanup(func() {
		subs.Shutdown(ctx)
		cancel()
		pool.Shutdown(context.Background())
	})
	return &llmd{indexer: indexer, pool: pool, subs: subs}
}

// score is llm-d's score of tokens for pod under model.
func (l *llmd) score(t *testing.T, tokens []uint32, model, pod string) float64 {
	t.Helper()
	scores, err := l.indexer.ScoreTokens(context.Background(), tokens, model, []string{pod}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return scores[pod]
}

// TestLLMDIndexesTheStore: llm-d v0.8.1's own subscriber, adapter, pool
// and indexer, subscribed to the publisher in the array form, score the
// store's pod by the blocks kvmesh announced: a BlockStored of 4 blocks of
// 16 tokens scores 4, a BlockRemoved of the third drops it to 2.
func TestLLMDIndexesTheStore(t *testing.T) {
	r := newRig(t, func(o *Options) { o.Form = contract.KVEventFormArray })
	l := newLLMD(t)
	if err := l.subs.EnsureSubscriber(context.Background(), DefaultPod, "tcp://"+r.p.Addr(), "kv@", true); err != nil {
		t.Fatal(err)
	}
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	hashes := []uint64{0xa1, 0xa2, 0xa3, 0xa4}
	// llm-d's subscriber connects when it will: the BlockStored is
	// published again until llm-d has indexed it (a repeat indexes the
	// same keys).
	topics := r.topics()
	until(t, "llm-d's subscription", topics)
	until(t, "llm-d's score of 4 blocks", func() bool {
		r.produce(stored(testKeys, nil, tokens, hashes...))
		return l.score(t, tokens, testKeys.Model, DefaultPod) == 4
	})
	r.produce(removed(testKeys, hashes[2]))
	until(t, "llm-d's score of 2 blocks after the third was removed", func() bool {
		return l.score(t, tokens, testKeys.Model, DefaultPod) == 2
	})
	if s := l.score(t, tokens, "another/model", DefaultPod); s != 0 {
		t.Errorf("score under another model %v, want 0: the topic names the model", s)
	}
}

// TestLLMDTokenlessStoreEvents: kvmesh's own BlockStored records carry no
// token ids; llm-d v0.8.1 still attaches the store's pod to blocks an
// engine pod announced with their tokens, since the store's hashes are the
// engine's (its device-tier update resolves them through the engine-hash
// mapping). The store's pod scores 4 for the engine's 4 blocks.
func TestLLMDTokenlessStoreEvents(t *testing.T) {
	r := newRig(t, func(o *Options) { o.Form = contract.KVEventFormArray })
	l := newLLMD(t)
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(7000 + i)
	}
	hashes := []uint64{0xb1, 0xb2, 0xb3, 0xb4}
	gpu := "GPU"
	engine, err := contract.EncodeKVEventBatch(contract.KVEventBatch{TS: 1, DataParallelRank: new(int), Events: []contract.KVEvent{{
		Kind: contract.BlockStored, BlockHashes: hashes, TokenIDs: tokens, BlockSize: 16, Medium: &gpu,
	}}}, contract.KVEventFormArray)
	if err != nil {
		t.Fatal(err)
	}
	l.pool.AddTask(&kvevents.RawMessage{Topic: "kv@engine-1@" + testKeys.Model, Payload: engine})
	until(t, "the engine's own blocks indexed", func() bool { return l.score(t, tokens, testKeys.Model, "engine-1") == 4 })
	if err := l.subs.EnsureSubscriber(context.Background(), DefaultPod, "tcp://"+r.p.Addr(), "kv@", true); err != nil {
		t.Fatal(err)
	}
	until(t, "llm-d's subscription", r.topics())
	until(t, "the store's pod scored through the engine's hashes", func() bool {
		r.produce(stored(testKeys, nil, nil, hashes...)) // as the sender writes it: no token ids
		return l.score(t, tokens, testKeys.Model, DefaultPod) == 4
	})
}

// TestLLMDAllBlocksCleared: llm-d v0.8.1 only logs an AllBlocksCleared, so
// the store's blocks stay in its index after a flush; with ClearAsRemoved
// the publisher follows the clear with BlockRemoved events of every block
// it announced, and llm-d's score of the flushed prompt drops to 0. Without
// it the score stays (checked once a later batch, behind the clear on the
// same pod's queue, was indexed).
func TestLLMDAllBlocksCleared(t *testing.T) {
	for _, clearAsRemoved := range []bool{true, false} {
		t.Run(fmt.Sprintf("clear_as_removed=%v", clearAsRemoved), func(t *testing.T) {
			r := newRig(t, func(o *Options) { o.Form = contract.KVEventFormArray; o.ClearAsRemoved = clearAsRemoved })
			l := newLLMD(t)
			if err := l.subs.EnsureSubscriber(context.Background(), DefaultPod, "tcp://"+r.p.Addr(), "kv@", true); err != nil {
				t.Fatal(err)
			}
			until(t, "llm-d's subscription", r.topics())
			first, later := tokenRun(3000, 64), tokenRun(5000, 32)
			until(t, "llm-d's score of 4 blocks", func() bool {
				r.produce(stored(testKeys, nil, first, 0xc1, 0xc2, 0xc3, 0xc4))
				return l.score(t, first, testKeys.Model, DefaultPod) == 4
			})
			r.produce(contract.KVEventRecord{
				Batch: contract.KVEventBatch{TS: 3, Events: []contract.KVEvent{{Kind: contract.AllBlocksCleared}}},
				Model: testKeys.Model, Namespace: "dep@org/model", Cause: "flushed",
			})
			r.produce(stored(testKeys, nil, later, 0xd1, 0xd2))
			until(t, "the batch after the clear indexed", func() bool { return l.score(t, later, testKeys.Model, DefaultPod) == 2 })
			want := 4.0
			if clearAsRemoved {
				want = 0
			}
			if got := l.score(t, first, testKeys.Model, DefaultPod); got != want {
				t.Fatalf("llm-d scores the flushed prompt %v after the clear, want %v", got, want)
			}
			if n := testutil.ToFloat64(r.metrics.clearedBlocks); clearAsRemoved && n != 4 {
				t.Errorf("cleared blocks counted %v, want 4", n)
			}
		})
	}
}

// tokenRun is n consecutive token ids from first.
func tokenRun(first uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = first + uint32(i)
	}
	return out
}

// TestClearBatchesChunks: the removals of a clear name every live hash once,
// in order, at most clearChunk an event, and leave the set empty.
func TestClearBatchesChunks(t *testing.T) {
	l := live{}
	n := clearChunk + 5
	for i := range n {
		l.trackEvent(contract.KVEvent{Kind: contract.BlockStored, BlockHashes: []uint64{uint64(i)}})
	}
	l.trackEvent(contract.KVEvent{Kind: contract.BlockRemoved, BlockHashes: []uint64{7}})
	batches := l.clearBatches(9)
	if len(batches) != 2 || len(l) != 0 {
		t.Fatalf("%d batches, %d hashes left; want 2 and 0", len(batches), len(l))
	}
	var got []uint64
	for _, b := range batches {
		e := b.Events[0]
		if e.Kind != contract.BlockRemoved || len(e.BlockHashes) > clearChunk || *e.Medium != contract.MediumStore || b.TS != 9 {
			t.Fatalf("batch %+v", b)
		}
		got = append(got, e.BlockHashes...)
	}
	if len(got) != n-1 || slices.Contains(got, 7) || !slices.IsSorted(got) {
		t.Fatalf("%d hashes (want %d, without the removed 7, sorted)", len(got), n-1)
	}
}

// TestLLMDChildBeforeParent: a save that hangs its blocks from a prefix it
// loaded can reach Kafka before the save that stored the prefix. llm-d
// v0.8.1 drops a block whose parent it has not indexed, so the publisher
// holds the child until the parent is announced: published child first,
// parent second, llm-d still scores all 4 blocks (it scores 2 when the
// records go through in Kafka's order, as the subtest without holding,
// HoldFor < 0, shows).
func TestLLMDChildBeforeParent(t *testing.T) {
	for _, tc := range []struct {
		name string
		hold time.Duration
		want float64
	}{
		{"held until the parent", time.Minute, 4},
		{"not held", -1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, func(o *Options) { o.Form = contract.KVEventFormArray; o.HoldFor = tc.hold })
			l := newLLMD(t)
			if err := l.subs.EnsureSubscriber(context.Background(), DefaultPod, "tcp://"+r.p.Addr(), "kv@", true); err != nil {
				t.Fatal(err)
			}
			until(t, "llm-d's subscription", r.topics())
			// A probe block of other tokens, until llm-d indexes it: its
			// subscription is live from then on.
			probe := tokenRun(9000, 16)
			until(t, "llm-d's score of a probe block", func() bool {
				r.produce(stored(testKeys, nil, probe, 0xf0))
				return l.score(t, probe, testKeys.Model, DefaultPod) == 1
			})
			tokens := tokenRun(2000, 64)
			parent := uint64(0xb2)
			r.produce(stored(testKeys, &parent, tokens[32:], 0xb3, 0xb4)) // the child, first
			r.produce(stored(testKeys, nil, tokens[:32], 0xb1, 0xb2))     // then its parent run
			until(t, "llm-d's score", func() bool { return l.score(t, tokens, testKeys.Model, DefaultPod) >= 2 })
			until(t, fmt.Sprintf("llm-d's score of %v blocks", tc.want), func() bool {
				return l.score(t, tokens, testKeys.Model, DefaultPod) == tc.want
			})
		})
	}
}

// TestHeldEvents: a held child goes after its parent (released), or after
// the hold without it (expired); one whose block is removed while it waits
// is never published (dropped); the seqs stay gapless.
func TestHeldEvents(t *testing.T) {
	r := newRig(t, func(o *Options) { o.HoldFor = 300 * time.Millisecond })
	sub := r.subscribe()
	parent, orphanParent := uint64(0xc2), uint64(0xee)
	r.produce(
		stored(testKeys, &parent, tokenRun(1, 16), 0xc3),        // held: 0xc2 not announced
		stored(testKeys, &orphanParent, tokenRun(50, 16), 0xd1), // held: 0xee never comes
		stored(testKeys, &orphanParent, tokenRun(70, 16), 0xd2), // held, then removed
		removed(testKeys, 0xd2),
		stored(testKeys, nil, tokenRun(90, 16), 0xc2), // the parent
	)
	var got []string
	var seqs []int64
	for len(got) < 4 {
		frames := recvFrames(t, sub)
		seqs = append(seqs, seqOf(t, frames[1]))
		b, err := contract.DecodeKVEventBatch(frames[2])
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range b.Events {
			got = append(got, fmt.Sprintf("%s %x", e.Kind, e.BlockHashes))
		}
	}
	want := []string{"BlockRemoved [d2]", "BlockStored [c2]", "BlockStored [c3]", "BlockStored [d1]"}
	if !slices.Equal(got, want) {
		t.Errorf("published %q, want %q", got, want)
	}
	for i := 1; i < len(seqs); i++ {
		if seqs[i] != seqs[i-1]+1 {
			t.Errorf("seqs %v have a gap", seqs)
		}
	}
	for outcome, n := range map[string]float64{HeldReleased: 1, HeldExpired: 1, HeldDropped: 1} {
		if v := testutil.ToFloat64(r.metrics.held.WithLabelValues(outcome)); v != n {
			t.Errorf("held %s = %v, want %v", outcome, v, n)
		}
	}
}
