package kvcore

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// The multi-rank scenarios: vLLM's own cases for MooncakeStoreConnector's
// key namespaces, lookup and striped saves
// (tests/v1/kv_connector/unit/test_mooncake_store_worker.py), as kvmesh
// scenarios S22–S29 (docs/architecture.md). Block size 16, hash block 16.

func TestScenariosParallel(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S22_tp2_full_plus_sharded_mamba_namespaces", scenarioTP2Namespaces},
		{"S23_tp2_sharded_mamba_one_rank_missing", scenarioTP2MambaShardMissing},
		{"S24_dcp4_tp4_every_dcp_namespace", scenarioDCP4},
		{"S25_mla_tp8_one_namespace_eight_loaders", scenarioMLATP8},
		{"S26_tp4_mixed_mla_gqa_mamba_replication", scenarioMixedReplication},
		{"S27_pcp2_namespaces", scenarioPCP2},
		{"S28_striped_puts_cover_every_namespace", scenarioStripedPuts},
		{"S29_refused_layouts", scenarioRefusedLayouts},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, sc.run)
	}
}

// nsPrefixes names the namespaces of group g as store-key prefixes.
func nsPrefixes(m *Model, g int) []string {
	kb := KeyBuilder{Model: m.Name}
	var out []string
	for _, r := range m.Namespaces(g) {
		out = append(out, kb.Namespace(r, g))
	}
	return out
}

func wantPrefixes(t *testing.T, m *Model, g int, want ...string) {
	t.Helper()
	if got := nsPrefixes(m, g); !slices.Equal(got, want) {
		t.Errorf("group %d namespaces = %q, want %q", g, got, want)
	}
}

// tp2FullMamba is vLLM's hybrid case: full attention with one KV head and
// Mamba state, at TP2.
func tp2FullMamba() *Model {
	m := lookupModel(16, grpFull(16), grpMamba(16))
	m.KVHeads = 1
	m.Parallel.TP = 2
	return m
}

// S22 (vLLM test_lookup_key_prefixes_expand_tp_sharded_groups_per_rank):
// replicated attention needs one namespace, sharded Mamba every rank's.
func scenarioTP2Namespaces(t *testing.T) {
	m := tp2FullMamba()
	wantPrefixes(t, m, 0, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0")
	wantPrefixes(t, m, 1, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1", "test-model@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1")
}

// S23 (vLLM test_lookup_rejects_boundary_missing_one_mamba_shard): 33
// tokens, every key present → 32; rank 1's Mamba shard missing → 0.
func scenarioTP2MambaShardMissing(t *testing.T) {
	m := tp2FullMamba()
	hashes := promptHashes(m, 33, 23)
	all := &storeFake{present: map[string]bool{}}
	p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, hashes, 33)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range p.Keys() {
		all.present[k] = true
	}
	if _, _, hit := lookupOnce(t, m, hashes, 33, all); hit != 32 {
		t.Errorf("every namespace holds the chunks: hit %d, want 32", hit)
	}
	missing := &storeFake{present: map[string]bool{}}
	for _, k := range p.Keys() {
		missing.present[k] = !(strings.Contains(k, "tp_rank:1") && strings.Contains(k, "group:1"))
	}
	if _, _, hit := lookupOnce(t, m, hashes, 33, missing); hit != 0 {
		t.Errorf("rank 1's Mamba shard missing: hit %d, want 0", hit)
	}
}

// S24 (vLLM test_lookup_requires_all_dcp_rank_namespaces): DCP4 at TP4, one
// full-attention group: a namespace per TP rank with dcp = tp % 4; 16
// tokens with the dcp2 namespace missing → 0, from exactly these keys.
func scenarioDCP4(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	m.KVHeads = 1
	m.Parallel = Parallel{TP: 4, DCP: 4}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	hashes := promptHashes(m, 16, 24)
	p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, hashes, 16)
	if err != nil {
		t.Fatal(err)
	}
	h := hashes[0].Hex()
	want := []string{
		"test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + h,
		"test-model@tp_rank:1@pcp0@dcp1@pp_rank:0@group:0@" + h,
		"test-model@tp_rank:2@pcp0@dcp2@pp_rank:0@group:0@" + h,
		"test-model@tp_rank:3@pcp0@dcp3@pp_rank:0@group:0@" + h,
	}
	if !slices.Equal(p.Keys(), want) {
		t.Fatalf("keys = %q, want %q", p.Keys(), want)
	}
	hit, err := p.Resolve([]bool{true, true, false, true})
	if err != nil || hit != 0 {
		t.Errorf("dcp2 missing: hit %d, %v; want 0", hit, err)
	}
	for _, r := range m.WorkerRanks() {
		if !m.Writes(0, r, 0) {
			t.Errorf("with DCP every rank writes its own namespace; %v does not write chunk 0", r)
		}
	}
}

// S25: MLA at TP8 (the seed's MLA group): one namespace, each chunk
// written by exactly one of the eight ranks, and all eight load every chunk
// from it.
func scenarioMLATP8(t *testing.T) {
	m := lookupModel(16, grpMLA(16), grpMamba(16))
	m.Parallel.TP = 8
	wantPrefixes(t, m, 0, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0")
	if n := len(m.Namespaces(1)); n != 8 {
		t.Errorf("sharded linear attention at TP8: %d namespaces, want 8", n)
	}
	kb := KeyBuilder{Model: m.Name}
	hashes := hexHashes(promptHashes(m, 256, 25))
	task := &SaveTask{Start: 0, End: 256, BlockTable: BlockTable{seqBlocks(16), seqBlocks(16)}, BlockHashes: hashes, Groups: m.SaveGroups(0, 256)}
	writes := map[string]int{}
	for _, r := range m.WorkerRanks() {
		for g := range m.Groups {
			items, err := PlanSend(m, kb, task, g, r)
			if err != nil {
				t.Fatal(err)
			}
			for _, it := range items {
				writes[it.Key]++
				if g == 0 && m.Writer(0, m.StoreRank(0, r), it.Chunk.Start/16) != r {
					t.Errorf("Writer disagrees with PlanSend for rank %v chunk %v", r, it.Chunk)
				}
			}
		}
	}
	// Group 0: 16 chunks in one namespace; group 1 (state at the save's
	// end only): 1 chunk in each of 8.
	if len(writes) != 16+8 {
		t.Errorf("%d distinct keys written, want %d", len(writes), 16+8)
	}
	for k, n := range writes {
		if n != 1 {
			t.Errorf("key %s written %d times, want once", k, n)
		}
	}
	loadTask := &LoadTask{Start: 0, End: 256, BlockTable: task.BlockTable, BlockHashes: hashes, Groups: m.LoadGroups(0, 256)}
	loaders := 0
	for _, r := range m.WorkerRanks() {
		items, err := PlanLoad(m, kb, loadTask, r)
		if err != nil {
			t.Fatal(err)
		}
		mla := 0
		for _, it := range items {
			if it.Group == 0 {
				mla++
				if !strings.HasPrefix(it.Key, "test-model@tp_rank:0@") {
					t.Errorf("rank %v loads MLA key %s outside tp_rank:0", r, it.Key)
				}
			}
		}
		if mla == 16 {
			loaders++
		}
	}
	if loaders != 8 {
		t.Errorf("%d ranks load every MLA chunk, want 8", loaders)
	}
}

func seqBlocks(n int) []BlockID {
	out := make([]BlockID, n)
	for i := range out {
		out[i] = BlockID(i + 1)
	}
	return out
}

// S26 (vLLM test_group_tp_replication_factors_mixed_mla_gqa_mamba): TP4,
// 2 KV heads: MLA replicated 4×, GQA 2×, Mamba 1×.
func scenarioMixedReplication(t *testing.T) {
	m := lookupModel(16, grpMLA(16), grpFull(16), grpMamba(16))
	m.KVHeads = 2
	m.Parallel.TP = 4
	for g, want := range []int{4, 2, 1} {
		if got := m.Replication(g); got != want {
			t.Errorf("group %d replication %d, want %d", g, got, want)
		}
	}
	wantPrefixes(t, m, 0, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0")
	wantPrefixes(t, m, 1, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1", "test-model@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1")
	wantPrefixes(t, m, 2, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:2", "test-model@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2",
		"test-model@tp_rank:2@pcp0@dcp0@pp_rank:0@group:2", "test-model@tp_rank:3@pcp0@dcp0@pp_rank:0@group:2")
	// GQA ranks 2 and 3 share namespace 1.
	if got := m.StoreRank(1, Rank{TP: 3}); got != (Rank{TP: 1}) {
		t.Errorf("GQA StoreRank(tp3) = %v, want tp1", got)
	}
}

// S27 (vLLM test_lookup_key_prefixes_cover_pcp_rank_namespaces): TP4, one
// KV head, PCP2: one namespace per PCP rank.
func scenarioPCP2(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	m.KVHeads = 1
	m.Parallel = Parallel{TP: 4, PCP: 2}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	wantPrefixes(t, m, 0, "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0", "test-model@tp_rank:0@pcp1@dcp0@pp_rank:0@group:0")
	if n := m.WorldSize(); n != 8 {
		t.Errorf("world size %d, want 8", n)
	}
}

// S28 (vLLM test_worker_put_striding_covers_every_rank_get_namespace and
// the sending thread's put_step cases): every key a rank gets was put by
// some rank, exactly once, with and without DCP; rank 0 of a 2-way stride
// saving from offset 16 puts chunk 2 only, rank 1 chunks 1 and 3.
func scenarioStripedPuts(t *testing.T) {
	for _, dcp := range []int{1, 4} {
		m := lookupModel(16, grpFull(16))
		m.KVHeads = 1
		m.Parallel = Parallel{TP: 4, DCP: dcp}
		kb := KeyBuilder{Model: m.Name}
		hashes := hexHashes(promptHashes(m, 64, 28))
		task := &SaveTask{Start: 0, End: 64, BlockTable: BlockTable{seqBlocks(4)}, BlockHashes: hashes, Groups: m.SaveGroups(0, 64)}
		put := map[string]int{}
		for _, r := range m.WorkerRanks() {
			items, _ := PlanSend(m, kb, task, 0, r)
			for _, it := range items {
				put[it.Key]++
			}
		}
		loadTask := &LoadTask{Start: 0, End: 64, BlockTable: task.BlockTable, BlockHashes: hashes, Groups: m.LoadGroups(0, 64)}
		for _, r := range m.WorkerRanks() {
			items, _ := PlanLoad(m, kb, loadTask, r)
			for _, it := range items {
				if put[it.Key] != 1 {
					t.Errorf("dcp %d: rank %v gets %s, put %d times", dcp, r, it.Key, put[it.Key])
				}
			}
		}
	}
	m := lookupModel(16, grpFull(16))
	m.KVHeads = 1
	m.Parallel.TP = 2
	kb := KeyBuilder{Model: m.Name}
	hashes := hexHashes(promptHashes(m, 64, 28))
	task := &SaveTask{Start: 16, End: 64, BlockTable: BlockTable{seqBlocks(4)}, BlockHashes: hashes, Groups: m.SaveGroups(16, 64)}
	for tp, want := range [][]int{{2}, {1, 3}} {
		items, err := PlanSend(m, kb, task, 0, Rank{TP: tp})
		if err != nil {
			t.Fatal(err)
		}
		var got []int
		for _, it := range items {
			got = append(got, it.Chunk.Start/16)
		}
		if !slices.Equal(got, want) {
			t.Errorf("rank %d puts chunks %v, want %v", tp, got, want)
		}
	}
}

// S29: the layouts vLLM refuses, refused with the field named.
func scenarioRefusedLayouts(t *testing.T) {
	cases := []struct {
		name  string
		m     *Model
		field string
	}{
		{"hybrid with dcp", withParallel(lookupModel(16, grpFull(16), grpMamba(16)), Parallel{TP: 2, DCP: 2}), "parallel"},
		{"hybrid with pcp", withParallel(lookupModel(16, grpMLA(16), grpMamba(16)), Parallel{PCP: 2}), "parallel"},
		{"dcp not dividing tp", withParallel(lookupModel(16, grpFull(16)), Parallel{TP: 4, DCP: 3}), "parallel.dcp"},
		{"block not a multiple of dcp×pcp", withParallel(lookupModel(2, grpFull(18)), Parallel{TP: 4, DCP: 4}), "groups[0].block_size"},
		{"kv heads not splittable", func() *Model {
			m := withParallel(lookupModel(16, grpFull(16)), Parallel{TP: 4})
			m.KVHeads = 3
			return m
		}(), "kv_heads"},
		{"negative kv heads", func() *Model { m := lookupModel(16, grpFull(16)); m.KVHeads = -1; return m }(), "kv_heads"},
	}
	for _, tc := range cases {
		err := tc.m.Validate()
		var se *SpecError
		if !errors.As(err, &se) || se.Field != tc.field {
			t.Errorf("%s: Validate() = %v, want a spec error on %s", tc.name, err, tc.field)
		}
	}
}

func withParallel(m *Model, p Parallel) *Model {
	m.Parallel = p
	return m
}

func TestWorkerRanks(t *testing.T) {
	m := lookupModel(16, grpFull(16))
	m.Parallel = Parallel{TP: 4, DCP: 2, PP: 2}
	got := m.WorkerRanks()
	if len(got) != 8 || m.WorldSize() != 8 {
		t.Fatalf("%d ranks (world %d), want 8", len(got), m.WorldSize())
	}
	for _, r := range got {
		if r.DCP != r.TP%2 || !m.IsWorkerRank(r) {
			t.Errorf("rank %v: dcp must be tp %% 2 and the rank known", r)
		}
	}
	if m.IsWorkerRank(Rank{TP: 1, DCP: 0}) || m.IsWorkerRank(Rank{TP: 4, DCP: 0}) || m.IsWorkerRank(Rank{PP: 2}) {
		t.Error("IsWorkerRank accepts a rank the engine does not run")
	}
	if one := lookupModel(16, grpFull(16)).WorkerRanks(); !slices.Equal(one, []Rank{{}}) {
		t.Errorf("TP1 ranks = %v, want [{}]", one)
	}
}

// TestWriterStripes checks Writer against Writes for every chunk, group
// and replication of a TP8 model.
func TestWriterStripes(t *testing.T) {
	m := lookupModel(16, grpMLA(16), grpFull(16), grpMamba(16))
	m.KVHeads = 2
	m.Parallel.TP = 8
	for g := range m.Groups {
		for _, ns := range m.Namespaces(g) {
			for c := range 20 {
				w := m.Writer(g, ns, c)
				if m.StoreRank(g, w) != ns || !m.Writes(g, w, c) {
					t.Fatalf("group %d ns %v chunk %d: Writer %v does not write it there", g, ns, c, w)
				}
				n := 0
				for _, r := range m.WorkerRanks() {
					if m.StoreRank(g, r) == ns && m.Writes(g, r, c) {
						n++
					}
				}
				if n != 1 {
					t.Fatalf("group %d ns %v chunk %d: %d writers, want 1", g, ns, c, n)
				}
			}
		}
	}
}
