package kvcore

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"gopkg.in/yaml.v3"
)

// Kind is the kind of attention a KV-cache group serves.
type Kind string

// The group kinds kvmesh knows.
const (
	// KindFullAttention is standard full attention: one block per block_size tokens, per TP rank.
	KindFullAttention Kind = "full_attention"
	// KindMLA is multi-head latent attention: like full attention, but its KV is
	// identical on every TP rank, so the ranks share one store namespace and
	// each chunk is written once (Model.Replication).
	KindMLA Kind = "mla"
	// KindSlidingWindow keeps only the last Window tokens' KV.
	KindSlidingWindow Kind = "sliding_window"
	// KindMamba is Mamba / linear-attention state: one state block at the hit
	// position. The state is sharded by TP rank: every rank has its own
	// namespace and writes every one of its blocks.
	KindMamba Kind = "mamba"
)

// Group is one KV-cache group of a model.
type Group struct {
	// Kind is the attention kind of the group.
	Kind Kind `json:"kind" yaml:"kind"`
	// BlockSize is the number of tokens one block of this group covers:
	// vLLM's scheduler-side block size of the group, which with context
	// parallelism (a single group, PCP or DCP above 1) is
	// cache_config.block_size × dcp × pcp (kv_cache_utils.py
	// resolve_kv_cache_block_sizes). With CacheBlockSize set it is derived
	// from it (Model.Resolve).
	BlockSize int `json:"block_size" yaml:"block_size"`
	// CacheBlockSize is the engine's cache_config.block_size (vLLM's
	// --block-size): the tokens one block holds on one rank. When set,
	// BlockSize is CacheBlockSize × dcp × pcp for a single-group model and
	// CacheBlockSize otherwise; zero leaves BlockSize as written.
	CacheBlockSize int `json:"cache_block_size,omitempty" yaml:"cache_block_size,omitempty"`
	// Window is the sliding window in tokens (sliding_window only).
	Window int `json:"window,omitempty" yaml:"window,omitempty"`
	// BytesPerBlock is the size of one block of this group on one worker
	// rank (its shard of the heads and its pipeline stage's layers).
	BytesPerBlock int64 `json:"bytes_per_block" yaml:"bytes_per_block"`
	// MambaCacheMode is vLLM's mamba_cache_mode of a Mamba group. Only
	// "align" (the default when empty) is accepted: MooncakeStoreScheduler
	// requires it, since only align mode keeps a state per cache block.
	MambaCacheMode string `json:"mamba_cache_mode,omitempty" yaml:"mamba_cache_mode,omitempty"`
}

// MambaAlign is the only Mamba cache mode vLLM's store connector accepts.
const MambaAlign = "align"

// Model is the KV-cache layout of one served model, shared by every service.
type Model struct {
	// Name is the model name used in store keys.
	Name string `json:"name" yaml:"name"`
	// HashBlockSize is the number of tokens per block hash. It divides every
	// group's block size.
	HashBlockSize int `json:"hash_block_size" yaml:"hash_block_size"`
	// Groups are the model's KV-cache groups, in group-index order.
	Groups []Group `json:"groups" yaml:"groups"`
	// KVHeads is the model's total number of KV heads (vLLM's
	// get_total_num_kv_heads). With fewer KV heads than TP ranks, groups of
	// tp/kv_heads ranks hold the same attention bytes and share a store
	// namespace. Zero means at least one head per rank (no sharing).
	KVHeads int `json:"kv_heads,omitempty" yaml:"kv_heads,omitempty"`
	// Parallel gives the engine's parallel layout: its worker ranks and,
	// with the groups' kinds and KVHeads, their store namespaces.
	Parallel Parallel `json:"parallel" yaml:"parallel"`
	// KVDtype is the KV cache's element type as the engine stores it
	// (vLLM's --kv-cache-dtype, resolved: "bfloat16", "fp8_e4m3", ...);
	// empty means DefaultKVDtype, the model's own dtype.
	KVDtype string `json:"kv_dtype,omitempty" yaml:"kv_dtype,omitempty"`
	// LayoutVersion numbers the engine's KV memory layout of the blocks
	// (the packing of layers, heads and tokens in a block, vLLM's
	// kv_cache_layout); an operator raises it when an engine upgrade
	// changes the layout without changing anything else the spec says.
	// Zero means DefaultLayoutVersion.
	LayoutVersion int `json:"layout_version,omitempty" yaml:"layout_version,omitempty"`
	// EngineVersion is the engine's version where it is stated (vLLM's
	// __version__): blocks of one engine version are never served to
	// another. Empty leaves the version out of the fingerprint.
	EngineVersion string `json:"engine_version,omitempty" yaml:"engine_version,omitempty"`
}

// Defaults of the compatibility fields of a Model.
const (
	// DefaultKVDtype is the KV dtype of a spec that names none: the
	// model's own dtype, as vLLM's --kv-cache-dtype auto.
	DefaultKVDtype = "auto"
	// DefaultLayoutVersion is the layout version of a spec that names none.
	DefaultLayoutVersion = 1
	// maxCompatText bounds kv_dtype and engine_version.
	maxCompatText = 64
)

// Rank identifies one rank namespace of a model: the tp/pcp/dcp/pp indices
// that appear in a store key.
type Rank struct {
	TP  int `json:"tp"`
	PCP int `json:"pcp"`
	DCP int `json:"dcp"`
	PP  int `json:"pp"`
}

// String names the rank as tp<t>-pcp<c>-dcp<d>-pp<p>, the form logs,
// consumer groups and task ids use.
func (r Rank) String() string {
	return fmt.Sprintf("tp%d-pcp%d-dcp%d-pp%d", r.TP, r.PCP, r.DCP, r.PP)
}

// RankNames names ranks (Rank.String), in order, for logs and reports.
func RankNames(ranks []Rank) []string {
	out := make([]string, len(ranks))
	for i, r := range ranks {
		out[i] = r.String()
	}
	return out
}

// SpecError is a model-spec validation error naming the offending field.
type SpecError struct {
	// Field is the path of the bad field, e.g. "groups[1].block_size".
	Field string
	// Problem says what is wrong with it.
	Problem string
}

func (e *SpecError) Error() string { return "model spec: " + e.Field + ": " + e.Problem }

// Validate reports the first problem with the spec as a *SpecError.
func (m *Model) Validate() error {
	if strings.TrimSpace(m.Name) == "" {
		return &SpecError{"name", "must not be empty"}
	}
	if strings.ContainsAny(m.Name, "@ \t\n") {
		return &SpecError{"name", "must not contain '@' or whitespace (it is part of store keys)"}
	}
	if m.HashBlockSize <= 0 {
		return &SpecError{"hash_block_size", "must be positive"}
	}
	if len(m.Groups) == 0 {
		return &SpecError{"groups", "a model needs at least one KV-cache group"}
	}
	for i, g := range m.Groups {
		if err := g.validate(i, m.HashBlockSize); err != nil {
			return err
		}
		if want := m.derivedBlockSize(i); g.CacheBlockSize > 0 && g.BlockSize != want {
			return &SpecError{fmt.Sprintf("groups[%d].block_size", i), fmt.Sprintf("%d, but cache_block_size %d with pcp × dcp %d makes it %d", g.BlockSize, g.CacheBlockSize, m.contextParallel(), want)}
		}
	}
	if m.KVHeads < 0 {
		return &SpecError{"kv_heads", "must not be negative"}
	}
	if err := m.validateCompat(); err != nil {
		return err
	}
	if err := m.validateParallel(); err != nil {
		return err
	}
	return m.validateHybrid()
}

// validateHybrid applies vLLM's rules for Mamba groups in a model served
// through the store connector:
//
//   - a Mamba group is in align mode (MooncakeStoreScheduler.__init__
//     asserts mamba_cache_mode == "align");
//   - its block size is the cache block size, the block size of the
//     model's full-attention and MLA groups (in align mode vLLM gives Mamba
//     cache_config.block_size; resolve_kv_cache_block_sizes in
//     vllm/v1/core/kv_cache_utils.py treats any other size as a non-align
//     layout and backs hashing off to the scheduler block size);
//   - where it turns on vLLM's fine-grained partial hash hits
//     (coordinator.py partial_hash_hits_enabled: a Mamba block larger than
//     the hash block, or any Mamba group with DCP), the layout is one
//     kvmesh models them for (validatePartial).
func (m *Model) validateHybrid() error {
	for i, g := range m.Groups {
		field := func(f string) string { return fmt.Sprintf("groups[%d].%s", i, f) }
		if g.Kind != KindMamba {
			if g.MambaCacheMode != "" {
				return &SpecError{field("mamba_cache_mode"), "only mamba groups have a cache mode"}
			}
			continue
		}
		if g.MambaCacheMode != "" && g.MambaCacheMode != MambaAlign {
			return &SpecError{field("mamba_cache_mode"), fmt.Sprintf("%q: vLLM's store connector requires %q", g.MambaCacheMode, MambaAlign)}
		}
		for j, a := range m.Groups {
			if (a.Kind == KindFullAttention || a.Kind == KindMLA) && a.BlockSize != g.BlockSize {
				return &SpecError{field("block_size"), fmt.Sprintf("%d is not the cache block size %d of groups[%d]: in align mode a Mamba group's block is the cache block", g.BlockSize, a.BlockSize, j)}
			}
		}
	}
	if m.PartialHashHits() {
		return m.validatePartial()
	}
	return nil
}

// validatePartial accepts the partial-hash-hit layouts kvmesh implements
// (lookups at every hash block, sub-block prompt tails, loads of sub-block
// chunks): full-attention, MLA and align-mode Mamba groups of one block
// size, without DCP. vLLM's FullAttentionManager and MambaManager probe
// interior hash boundaries (supports_fine_grained_hash_lookup in
// vllm/v1/core/single_type_kv_cache_manager.py); a sliding-window group
// under partial hits and DCP's rescaled Mamba specs
// (kv_cache_utils.py resolve_dcp_kv_cache_spec) are not modelled, so those
// layouts are refused rather than disagree with vLLM about hits.
func (m *Model) validatePartial() error {
	if size(m.Parallel.DCP) > 1 {
		return &SpecError{"hash_block_size", fmt.Sprintf("%d with a Mamba group and DCP %d turns on vLLM's partial hash hits, which kvmesh does not model with DCP (its Mamba specs are rescaled per rank)", m.HashBlockSize, m.Parallel.DCP)}
	}
	for i, g := range m.Groups {
		if g.Kind == KindSlidingWindow {
			return &SpecError{"hash_block_size", fmt.Sprintf("%d is finer than a Mamba group's block, which turns on vLLM's partial hash hits; kvmesh models them for full-attention, MLA and Mamba groups only, not beside sliding-window groups[%d]; make hash_block_size the Mamba block size", m.HashBlockSize, i)}
		}
		if g.BlockSize != m.Groups[0].BlockSize {
			return &SpecError{fmt.Sprintf("groups[%d].block_size", i), fmt.Sprintf("%d differs from groups[0]'s %d: with partial hash hits kvmesh needs one block size for every group", g.BlockSize, m.Groups[0].BlockSize)}
		}
	}
	return nil
}

// HitAlignment is the granularity of a hit (coordinator.py
// MooncakeStoreCoordinator.align_lookup_length): the hash block size with
// partial hash hits, the scheduler block size otherwise.
func (m *Model) HitAlignment() int {
	if m.PartialHashHits() {
		return m.HashBlockSize
	}
	return m.SchedulerBlockSize()
}

// PartialHashHits reports whether vLLM would turn on fine-grained partial
// hash hits for this layout (coordinator.py partial_hash_hits_enabled): some
// align-mode Mamba group's block is larger than the hash block, or, with
// DCP, at least as large.
func (m *Model) PartialHashHits() bool {
	for _, g := range m.Groups {
		if g.Kind != KindMamba || (g.MambaCacheMode != "" && g.MambaCacheMode != MambaAlign) {
			continue
		}
		if size(m.Parallel.DCP) == 1 && g.BlockSize > m.HashBlockSize || size(m.Parallel.DCP) > 1 && g.BlockSize >= m.HashBlockSize {
			return true
		}
	}
	return false
}

func (g Group) validate(i, hashBS int) error {
	field := func(f string) string { return fmt.Sprintf("groups[%d].%s", i, f) }
	switch g.Kind {
	case KindFullAttention, KindMLA, KindMamba:
		if g.Window != 0 {
			return &SpecError{field("window"), "only sliding_window groups have a window"}
		}
	case KindSlidingWindow:
		if g.Window <= 0 {
			return &SpecError{field("window"), "sliding_window needs a positive window"}
		}
	default:
		return &SpecError{field("kind"), fmt.Sprintf("unknown kind %q (want full_attention, mla, sliding_window or mamba)", g.Kind)}
	}
	if g.BlockSize <= 0 {
		return &SpecError{field("block_size"), "must be positive"}
	}
	if g.BlockSize%hashBS != 0 {
		return &SpecError{field("block_size"), fmt.Sprintf("%d is not a multiple of hash_block_size %d", g.BlockSize, hashBS)}
	}
	if g.BytesPerBlock <= 0 {
		return &SpecError{field("bytes_per_block"), "must be positive"}
	}
	return nil
}

// SchedulerBlockSize is the lcm of every group's block size: hits and saves
// are aligned to it.
func (m *Model) SchedulerBlockSize() int {
	l := 1
	for _, g := range m.Groups {
		l = lcm(l, g.BlockSize)
	}
	return l
}

// Fingerprint is the model's compatibility fingerprint: 16 hex characters
// of a digest of everything that decides a block's bytes — the model name,
// KV dtype, layout version and engine version (with their defaults
// applied), the hash block size, every group (kind, block sizes, window,
// bytes per block), the KV heads and the parallel layout. It is a segment
// of every store key (KeyBuilder.Fingerprint), so a block written under
// another layout is a miss, and it is stored beside every value
// (dataplane.EncodeValue), so such a value is never loaded either.
func (m *Model) Fingerprint() string {
	c := *m
	c.KVDtype, c.LayoutVersion = m.EffectiveKVDtype(), m.EffectiveLayoutVersion()
	b, _ := json.Marshal(&c) // a Model always marshals
	h := HashTokens(nil, nil, b)
	return h.Hex()[:FingerprintLen]
}

// FingerprintLen is the length of Model.Fingerprint.
const FingerprintLen = 16

// EffectiveKVDtype is KVDtype, or DefaultKVDtype when the spec names none.
func (m *Model) EffectiveKVDtype() string {
	if m.KVDtype == "" {
		return DefaultKVDtype
	}
	return m.KVDtype
}

// EffectiveLayoutVersion is LayoutVersion, or DefaultLayoutVersion when the
// spec names none.
func (m *Model) EffectiveLayoutVersion() int {
	if m.LayoutVersion == 0 {
		return DefaultLayoutVersion
	}
	return m.LayoutVersion
}

// validateCompat checks the compatibility fields: kv_dtype and
// engine_version are short texts of [A-Za-z0-9._+-], the layout version is
// not negative.
func (m *Model) validateCompat() error {
	for _, f := range []struct{ name, v string }{{"kv_dtype", m.KVDtype}, {"engine_version", m.EngineVersion}} {
		if problem := compatTextProblem(f.v); problem != "" {
			return &SpecError{f.name, problem}
		}
	}
	if m.LayoutVersion < 0 {
		return &SpecError{"layout_version", "must not be negative"}
	}
	return nil
}

// compatTextProblem says what keeps v from being a compatibility text (at
// most maxCompatText bytes of [A-Za-z0-9._+-]), or "" when nothing does.
func compatTextProblem(v string) string {
	if len(v) > maxCompatText {
		return fmt.Sprintf("%d bytes, at most %d", len(v), maxCompatText)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; !tenantByte(c) && c != '+' {
			return fmt.Sprintf("%q: byte %d (%q) is not one of [A-Za-z0-9._+-]", v, i, c)
		}
	}
	return ""
}

// ValidateEngineVersion reports an engine version an engine cannot state:
// more than 64 bytes, or a byte outside [A-Za-z0-9._+-] (vLLM's versions,
// such as 0.11.2+cu128, fit). Empty states none. The error wraps
// ErrBadEngineVersion.
func ValidateEngineVersion(v string) error {
	if problem := compatTextProblem(v); problem != "" {
		return fmt.Errorf("engine version %s: %w", problem, ErrBadEngineVersion)
	}
	return nil
}

// CheckEngineVersion reports whether an engine stating version stated may
// use the model's keys: it may unless the spec pins an engine version
// (EngineVersion, part of the fingerprint) and the engine states another.
// An engine that states none is taken at the spec's word. The error wraps
// ErrBadEngineVersion or ErrEngineVersion.
func (m *Model) CheckEngineVersion(stated string) error {
	if err := ValidateEngineVersion(stated); err != nil {
		return err
	}
	if m.EngineVersion != "" && stated != "" && stated != m.EngineVersion {
		return fmt.Errorf("engine version %q, the model %s's blocks are of engine version %q: %w", stated, m.Name, m.EngineVersion, ErrEngineVersion)
	}
	return nil
}

func size(n int) int {
	if n <= 0 {
		return 1
	}
	return n
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func lcm(a, b int) int { return a / gcd(a, b) * b }

// Resolve derives every block size given as a CacheBlockSize from the
// parallel layout, then validates the model. Call it after changing the
// spec's parallel sizes (service.ParallelOverride does); a model in use is
// never changed, since Validate only checks.
func (m *Model) Resolve() error {
	for i := range m.Groups {
		if m.Groups[i].CacheBlockSize < 0 {
			return &SpecError{fmt.Sprintf("groups[%d].cache_block_size", i), "must not be negative"}
		}
		if m.Groups[i].CacheBlockSize > 0 {
			m.Groups[i].BlockSize = m.derivedBlockSize(i)
		}
	}
	return m.Validate()
}

// derivedBlockSize is group g's block size from its CacheBlockSize.
func (m *Model) derivedBlockSize(g int) int {
	if len(m.Groups) == 1 {
		return m.Groups[g].CacheBlockSize * m.contextParallel()
	}
	return m.Groups[g].CacheBlockSize
}

// contextParallel is pcp × dcp.
func (m *Model) contextParallel() int {
	return size(m.Parallel.PCP) * size(m.Parallel.DCP)
}

// ParseModel decodes and validates a model spec from JSON or YAML (JSON is
// YAML, but JSON is decoded strictly: unknown fields are errors).
func ParseModel(data []byte) (*Model, error) {
	var m Model
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) > 0 && trimmed[0] == '{' {
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&m); err != nil {
			return nil, fmt.Errorf("model spec: decode json: %w", err)
		}
	} else {
		dec := yaml.NewDecoder(bytes.NewReader(trimmed))
		dec.KnownFields(true)
		if err := dec.Decode(&m); err != nil {
			return nil, fmt.Errorf("model spec: decode yaml: %w", err)
		}
	}
	for i, g := range m.Groups {
		if g.CacheBlockSize > 0 && g.BlockSize != 0 && g.BlockSize != m.derivedBlockSize(i) {
			return nil, &SpecError{fmt.Sprintf("groups[%d].block_size", i), fmt.Sprintf("%d disagrees with cache_block_size %d (pcp × dcp %d): give one of them", g.BlockSize, g.CacheBlockSize, m.contextParallel())}
		}
	}
	if err := m.Resolve(); err != nil {
		return nil, err
	}
	return &m, nil
}
