package kvcore

import (
	"encoding/json"
	"testing"
)

// The null-block scenarios of issue 14: an engine declares the id its
// block tables use for the null block, and the edge that receives the
// tables turns it into NullBlock once. vLLM's null block is block 0:
// BlockPool.__init__ (vllm/v1/core/block_pool.py) pops the first free block
// as null_block, and block tables carry NULL_BLOCK_ID = 0
// (vllm/v1/attention/backends/utils.py; the store scheduler and worker,
// .../mooncake/store/scheduler.py and worker.py, import it to skip null
// entries). Engines that send JSON null keep the default (no declaration).

// nullOf is a declared null block id.
func nullOf(v int64) *int64 { return &v }

// decodeTable decodes a JSON block table.
func decodeTable(t *testing.T, s string) BlockTable {
	t.Helper()
	var tb BlockTable
	if err := json.Unmarshal([]byte(s), &tb); err != nil {
		t.Fatalf("decode %s: %v", s, err)
	}
	return tb
}

// S86: no declaration is NullBlock; a declaration is its id.
func scenarioEngineNullBlock(t *testing.T) {
	if got := EngineNullBlock(nil); got != NullBlock {
		t.Fatalf("EngineNullBlock(nil) = %d", got)
	}
	if got := EngineNullBlock(nullOf(0)); got != 0 {
		t.Fatalf("EngineNullBlock(0) = %d", got)
	}
	var nilTable BlockTable
	if got := nilTable.NormalizeNull(0); got != nil {
		t.Fatalf("nil table normalised to %v", got)
	}
}

func TestScenariosNull(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S86_engine_null_block", scenarioEngineNullBlock},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}
