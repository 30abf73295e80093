package kvcore

import "fmt"

// The parallel layout follows vLLM's MooncakeStoreConnector
// (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/):
//
//   - worker.py MooncakeStoreWorker.__init__: a worker's key namespace for
//     group g is (tp_rank // replication(g), pcp_rank, dcp_rank, pp_rank),
//     with dcp_rank the rank in the DCP group (tp_rank % dcp: DCP subdivides
//     TP).
//   - worker.py _spec_tp_replication_factor: the number of TP ranks holding
//     byte-identical values of a group: 1 with DCP > 1 and for Mamba /
//     linear-attention state (sharded by rank), tp for MLA, else
//     max(1, tp // total_num_kv_heads).
//   - worker.py _init_lookup_key_prefixes: the namespaces a lookup checks,
//     every one of which must hold a chunk for it to count.
//   - worker.py KVCacheStoreSendingThread._handle_request and data.py
//     ChunkedTokenDatabase.process_tokens: the ranks sharing a namespace
//     stripe its chunks, so each is written once: rank r writes chunk c of
//     group g iff c % f == (tp_rank + g) % f, f the replication factor.
//     Every rank loads every chunk of its own namespace.
//   - connector.py _validate_kv_cache_config: a hybrid model (more than one
//     group) with PCP or DCP is refused; kv_cache_utils.py
//     resolve_kv_cache_block_sizes and MooncakeStoreWorker.__init__: a
//     single group's block size is cache_config.block_size × dcp × pcp
//     (Group.CacheBlockSize, Model.Resolve).

// Parallel gives the sizes of an engine's parallel dimensions. A zero size
// means 1. The engine runs one worker per (tp, pcp, pp) rank; DCP divides
// the TP ranks (a worker's dcp rank is tp_rank % dcp).
type Parallel struct {
	// TP is the tensor-parallel size.
	TP int `json:"tp,omitempty" yaml:"tp,omitempty"`
	// PCP is the prefill context-parallel size.
	PCP int `json:"pcp,omitempty" yaml:"pcp,omitempty"`
	// DCP is the decode context-parallel size; it divides TP.
	DCP int `json:"dcp,omitempty" yaml:"dcp,omitempty"`
	// PP is the pipeline-parallel size.
	PP int `json:"pp,omitempty" yaml:"pp,omitempty"`
}

// validateParallel checks the sizes and refuses the layouts vLLM's
// MooncakeStoreConnector refuses.
func (m *Model) validateParallel() error {
	p := m.Parallel
	for _, d := range []struct {
		name string
		v    int
	}{{"parallel.tp", p.TP}, {"parallel.pcp", p.PCP}, {"parallel.dcp", p.DCP}, {"parallel.pp", p.PP}} {
		if d.v < 0 {
			return &SpecError{d.name, "must not be negative"}
		}
	}
	tp, pcp, dcp := size(p.TP), size(p.PCP), size(p.DCP)
	if tp%dcp != 0 {
		return &SpecError{"parallel.dcp", fmt.Sprintf("%d does not divide tp %d (decode context parallelism splits the TP ranks)", dcp, tp)}
	}
	if len(m.Groups) > 1 && pcp*dcp > 1 {
		return &SpecError{"parallel", fmt.Sprintf("pcp %d × dcp %d with %d KV-cache groups: vLLM's MooncakeStoreConnector does not support context parallelism with hybrid attention", pcp, dcp, len(m.Groups))}
	}
	if cp := pcp * dcp; cp > 1 && m.Groups[0].BlockSize%cp != 0 {
		return &SpecError{"groups[0].block_size", fmt.Sprintf("%d is not a multiple of pcp × dcp = %d: with context parallelism the block size is cache_config.block_size × dcp × pcp (give cache_block_size to have it derived)", m.Groups[0].BlockSize, cp)}
	}
	if h := m.KVHeads; h > 0 && tp%h != 0 && h%tp != 0 {
		return &SpecError{"kv_heads", fmt.Sprintf("%d KV heads cannot be split over %d TP ranks (one must divide the other)", h, tp)}
	}
	return nil
}

// WorldSize is the number of worker ranks of one engine: tp × pcp × pp.
func (m *Model) WorldSize() int {
	p := m.Parallel
	return size(p.TP) * size(p.PCP) * size(p.PP)
}

// WorkerRanks lists every worker rank of one engine, pcp outermost, then
// tp, then pp. A worker's DCP index is tp_rank % dcp (0 without DCP).
func (m *Model) WorkerRanks() []Rank {
	p := m.Parallel
	dcp := size(p.DCP)
	out := make([]Rank, 0, m.WorldSize())
	for c := 0; c < size(p.PCP); c++ {
		for t := 0; t < size(p.TP); t++ {
			for pp := 0; pp < size(p.PP); pp++ {
				out = append(out, Rank{TP: t, PCP: c, DCP: t % dcp, PP: pp})
			}
		}
	}
	return out
}

// IsWorkerRank reports whether r is one of the engine's worker ranks.
func (m *Model) IsWorkerRank(r Rank) bool {
	p := m.Parallel
	return r.TP >= 0 && r.TP < size(p.TP) && r.PCP >= 0 && r.PCP < size(p.PCP) &&
		r.PP >= 0 && r.PP < size(p.PP) && r.DCP == r.TP%size(p.DCP)
}

// Replication is the number of TP ranks that hold byte-identical values of
// group g, and so share one store namespace: 1 with DCP, 1 for Mamba /
// linear-attention state, tp for MLA, otherwise max(1, tp / KVHeads).
func (m *Model) Replication(g int) int {
	p := m.Parallel
	tp := size(p.TP)
	switch {
	case size(p.DCP) > 1, m.Groups[g].Kind == KindMamba:
		return 1
	case m.Groups[g].Kind == KindMLA:
		return tp
	case m.KVHeads <= 0:
		return 1
	default:
		return max(1, tp/m.KVHeads)
	}
}

// StoreRank is the namespace worker rank r reads and writes for group g:
// its TP index divided by the group's replication.
func (m *Model) StoreRank(g int, r Rank) Rank {
	r.TP /= m.Replication(g)
	return r
}

// Namespaces lists the store namespaces of group g: every one must hold a
// chunk for a lookup to count it. They are the distinct StoreRanks of the
// worker ranks, in WorkerRanks order.
func (m *Model) Namespaces(g int) []Rank {
	var out []Rank
	seen := map[Rank]bool{}
	for _, r := range m.WorkerRanks() {
		sr := m.StoreRank(g, r)
		if !seen[sr] {
			seen[sr] = true
			out = append(out, sr)
		}
	}
	return out
}

// Writes reports whether worker rank r writes chunk index c (the chunk's
// start over the group's block size) of group g: the ranks sharing a
// namespace take its chunks in turn, starting at an offset of g so that
// groups spread over the ranks.
func (m *Model) Writes(g int, r Rank, c int) bool {
	f := m.Replication(g)
	return c%f == (r.TP+g)%f
}

// Writer is the worker rank that writes chunk index c of group g into
// namespace ns (one of Namespaces(g)).
func (m *Model) Writer(g int, ns Rank, c int) Rank {
	f := m.Replication(g)
	w := ns
	phase := ((c-g)%f + f) % f // the rank offset t with (t + g) % f == c % f
	w.TP = ns.TP*f + phase
	return w
}
