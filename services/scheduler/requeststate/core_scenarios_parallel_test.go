package requeststate

import (
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestCacheBlockSizeScalesWithContextParallelism: a single group given as
// vLLM's cache_config.block_size gets the block size vLLM's connector
// keys by — block × dcp × pcp — and a re-layout re-derives it; a hybrid
// model's groups keep theirs; a block size that disagrees is refused.
func TestCacheBlockSizeScalesWithContextParallelism(t *testing.T) {
	m, err := kvcore.ParseModel([]byte(`{"name":"test-model","hash_block_size":4,"kv_heads":1,
		"groups":[{"kind":"full_attention","cache_block_size":4,"bytes_per_block":64}],"parallel":{"tp":4,"dcp":4}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Groups[0].BlockSize; got != 16 || m.SchedulerBlockSize() != 16 {
		t.Fatalf("block size %d (scheduler %d), want 4 × dcp 4 = 16", got, m.SchedulerBlockSize())
	}
	m.Parallel = kvcore.Parallel{TP: 4, DCP: 2}
	if err := m.Validate(); err == nil {
		t.Fatal("Validate accepted a block size the new layout does not derive")
	}
	if err := m.Resolve(); err != nil || m.Groups[0].BlockSize != 8 {
		t.Fatalf("Resolve at dcp 2: block %d, %v; want 8", m.Groups[0].BlockSize, err)
	}
	m.Parallel = kvcore.Parallel{TP: 4, DCP: 2, PCP: 2}
	if err := m.Resolve(); err != nil || m.Groups[0].BlockSize != 16 {
		t.Fatalf("Resolve at pcp 2 dcp 2: block %d, %v; want 16", m.Groups[0].BlockSize, err)
	}
	m.Parallel = kvcore.Parallel{TP: 4}
	if err := m.Resolve(); err != nil || m.Groups[0].BlockSize != 4 {
		t.Fatalf("Resolve without context parallelism: block %d, %v; want 4", m.Groups[0].BlockSize, err)
	}
	hybrid, err := kvcore.ParseModel([]byte(`{"name":"h","hash_block_size":16,"groups":[
		{"kind":"mla","cache_block_size":16,"bytes_per_block":64},{"kind":"mamba","block_size":16,"bytes_per_block":64}]}`))
	if err != nil || hybrid.Groups[0].BlockSize != 16 {
		t.Fatalf("hybrid: %v, %+v", err, hybrid)
	}
	_, err = kvcore.ParseModel([]byte(`{"name":"x","hash_block_size":4,"groups":[{"kind":"full_attention","block_size":4,"cache_block_size":4,"bytes_per_block":64}],"parallel":{"tp":2,"dcp":2}}`))
	var se *kvcore.SpecError
	if !errors.As(err, &se) || se.Field != "groups[0].block_size" {
		t.Fatalf("disagreeing block_size: %v, want a spec error on groups[0].block_size", err)
	}
	again, err := kvcore.ParseModel(mustJSON(t, m))
	if err != nil || again.Groups[0].BlockSize != 4 || again.Fingerprint() != m.Fingerprint() {
		t.Fatalf("round trip: %v, %+v", err, again)
	}
}
