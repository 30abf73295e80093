package sim

import (
	"maps"
	"time"
)

// Preset is a named starting point of a run: the model the services must
// serve (their KVMESH_MODEL), whether the engines run 1P1D, the workload
// and the engines' sizes. `kvmesh sim --preset NAME` starts from it.
type Preset struct {
	// Summary says what the preset plays, in a few words.
	Summary string `json:"summary"`
	// Model is the model preset or spec the services must serve.
	Model string `json:"model"`
	// PD runs 1P1D (Config.PD): every decode engine gets a prefill engine.
	PD bool `json:"pd"`
	// Workload is what the engines are asked.
	Workload Workload `json:"workload"`
	// Engine sizes every engine.
	Engine EngineConfig `json:"engine"`
	// ReusePreempted frees preempted requests' blocks at once, even with
	// saves in flight (Config.ReusePreempted).
	ReusePreempted bool `json:"reuse_preempted"`
	// WorkerPoolBlocks, when set, is the KVMESH_POOL_BLOCKS every gpuworker
	// needs at least: the gpuworkers' default pool (1024 blocks per group)
	// is too small for the preset's prompts.
	WorkerPoolBlocks int `json:"worker_pool_blocks,omitempty"`
}

// Long-context prompts: the bounds of every prompt the long-context preset
// generates.
const (
	// LongContextMinPrompt is the shortest long-context prompt (8K tokens).
	LongContextMinPrompt = 8 << 10
	// LongContextMaxPrompt is the longest long-context prompt (32K tokens).
	LongContextMaxPrompt = 32 << 10
)

// presetOrder lists the presets as PresetNames returns them.
var presetOrder = []string{"seed", "smoke", "dense", "swa", "long-context"}

// presets are the shipped workloads. "seed" is the configuration of the
// seed bug report: a 2-group hybrid model (MLA + linear attention) at TP8,
// so every engine runs eight gpuworkers (the MLA group one namespace whose
// chunks the ranks write in turn, the linear-attention state one namespace
// per rank), 1P1D with the pd,store connector chain, and a deliberately
// small GPU pool so prefixes are evicted and must be reloaded, and
// requests are preempted with their blocks reused at once while saves of
// them are in flight (8 conversations a second keep the decode engine's
// pool under pressure). The other presets play single-rank engines.
//
// "long-context" is document question answering: prompts of 8K to 32K
// tokens (LongContextMinPrompt to LongContextMaxPrompt), each a shared
// document of 6K to 24K tokens (six of them, so that conversations on any
// engine find a document's prefix in the store or in their engine's cache)
// and a question with its own context of 2K to 3.5K tokens, asked once or
// twice (a follow-up repeats the whole first turn). The engines prefill in
// chunks of the 4096-token step budget, as vLLM's chunked prefill does, in
// a pool of 4096 blocks per group (64K tokens of the hybrid model: two of
// the longest prompts at once, so admissions wait for room and evict
// cached documents), which the gpuworkers must hold
// (KVMESH_POOL_BLOCKS=4096).
var presets = map[string]Preset{
	"seed": {
		Summary: "hybrid-mla-linear at TP8 (8 gpuworkers per engine), 1P1D (pd,store), small pool, 300 requests",
		Model:   "hybrid-mla-linear-tp8", PD: true,
		Workload: Workload{Requests: 300, Turns: Range{Min: 2, Max: 5}, SystemPrompts: 4,
			SystemTokens: Range{Min: 128, Max: 512}, UserTokens: Range{Min: 16, Max: 160},
			OutputTokens: Range{Min: 8, Max: 48}, Rate: 8, ThinkTime: 20 * time.Millisecond, Seed: 54643, Vocab: 32000},
		Engine:         EngineConfig{PoolBlocks: 192, MaxBatchTokens: 512, MaxRunning: 16, Watermark: 2},
		ReusePreempted: true,
	},
	"smoke": {
		Summary: "hybrid-mla-linear, one engine, 16 requests",
		Model:   "hybrid-mla-linear",
		Workload: Workload{Requests: 16, Turns: Range{Min: 2, Max: 3}, SystemPrompts: 2,
			SystemTokens: Range{Min: 64, Max: 128}, UserTokens: Range{Min: 8, Max: 48},
			OutputTokens: Range{Min: 4, Max: 20}, Rate: 8, Seed: 1, Vocab: 32000},
		Engine: EngineConfig{PoolBlocks: 64, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1},
	},
	"dense": {
		Summary: "dense-8b (2 MiB blocks), one engine, 40 requests",
		Model:   "dense",
		Workload: Workload{Requests: 40, Turns: Range{Min: 2, Max: 4}, SystemPrompts: 2,
			SystemTokens: Range{Min: 64, Max: 256}, UserTokens: Range{Min: 16, Max: 64},
			OutputTokens: Range{Min: 8, Max: 32}, Rate: 4, Seed: 2, Vocab: 32000},
		Engine: EngineConfig{PoolBlocks: 96, MaxBatchTokens: 512, MaxRunning: 8, Watermark: 1},
	},
	"swa": {
		Summary: "full-swa-mamba (3 groups), 1P1D, 80 requests",
		Model:   "full-swa-mamba", PD: true,
		Workload: Workload{Requests: 80, Turns: Range{Min: 2, Max: 4}, SystemPrompts: 3,
			SystemTokens: Range{Min: 128, Max: 384}, UserTokens: Range{Min: 16, Max: 128},
			OutputTokens: Range{Min: 8, Max: 40}, Rate: 4, Seed: 3, Vocab: 32000},
		Engine: EngineConfig{PoolBlocks: 160, MaxBatchTokens: 512, MaxRunning: 12, Watermark: 2},
	},
	"long-context": {
		Summary: "hybrid-mla-linear, 8K-32K-token prompts over shared documents, chunked prefill, 24 requests (KVMESH_POOL_BLOCKS=4096)",
		Model:   "hybrid-mla-linear",
		// Prompts: 6144+2048 = 8192 at least; 24576+3584+64+3584 = 31808
		// at most (a second turn holds the first turn and its reply).
		Workload: Workload{Requests: 24, Turns: Range{Min: 1, Max: 2}, SystemPrompts: 6,
			SystemTokens: Range{Min: 6144, Max: 24576}, UserTokens: Range{Min: 2048, Max: 3584},
			OutputTokens: Range{Min: 16, Max: 64}, Rate: 2, ThinkTime: 20 * time.Millisecond, Seed: 32768, Vocab: 32000},
		Engine:           EngineConfig{PoolBlocks: 4096, MaxBatchTokens: 4096, MaxRunning: 4, Watermark: 8},
		WorkerPoolBlocks: 4096,
	},
}

// PresetNames lists the shipped presets, the seed's first.
func PresetNames() []string { return append([]string(nil), presetOrder...) }

// LookupPreset returns the shipped preset name and whether there is one.
func LookupPreset(name string) (Preset, bool) {
	p, ok := presets[name]
	return p, ok
}

// Presets returns every shipped preset by name (a copy).
func Presets() map[string]Preset { return maps.Clone(presets) }
