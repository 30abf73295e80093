// Package llmdtest starts llm-d-kv-cache's released indexer (v0.8.1, the
// router side of kvmesh.kv.events and of the lookup's ZMQ publisher) for
// tests that hold kvmesh's events to the neighbour's own code.
package llmdtest

import (
	"context"
	"sync"
	"testing"

	"github.com/go-logr/logr"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"sigs.k8s.io/controller-runtime/pkg/log"
)

// Tiers are the device tiers an Indexer scores, each weighing 1 (llm-d's
// default weighs cpu 0.8 and storage nothing), so that a score counts the
// blocks kvmesh announces in Redis (cpu) and in the capacity tier
// (storage) as an engine's own.
var Tiers = []string{"gpu", "cpu", "storage"}

var quiet sync.Once

// NewIndexer returns llm-d's indexer over its in-memory index, with a
// token processor of blockSize tokens a block (0: llm-d's default). llm-d
// logs through controller-runtime's root logger, which prints a stack
// trace ("log.SetLogger(...) was never called") when nothing is set: it
// is set to discard once (a test that wants llm-d's lines passes a logger
// in the context).
func NewIndexer(ctx context.Context, t testing.TB, blockSize int) (*kvcache.Indexer, kvblock.TokenProcessor) {
	t.Helper()
	quiet.Do(func() { log.SetLogger(logr.Discard()) })
	tpc := kvblock.DefaultTokenProcessorConfig()
	if blockSize > 0 {
		tpc.BlockSizeTokens = blockSize
	}
	tp, err := kvblock.NewChunkedTokenDatabase(tpc)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := kvcache.NewDefaultConfig()
	if err != nil {
		t.Fatal(err)
	}
	cfg.BackendConfigs = nil
	for _, name := range Tiers {
		cfg.BackendConfigs = append(cfg.BackendConfigs, &kvcache.KVCacheBackendConfig{Name: name, Weight: 1})
	}
	ix, err := kvcache.NewKVCacheIndexer(ctx, cfg, tp)
	if err != nil {
		t.Fatal(err)
	}
	return ix, tp
}
