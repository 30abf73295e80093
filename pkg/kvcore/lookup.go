package kvcore

import (
	"bytes"
	"fmt"
	"hash/maphash"
	"math/bits"
	"slices"
	"strings"
	"sync"
)

// LookupPlan is the store lookup of one request: the flat, deduplicated list
// of keys to check in one batched existence round-trip, and the structure to
// turn the store's answers into a hit. Build it with PlanLookup; it is not
// modified afterwards, so Hit may be evaluated any number of times.
type LookupPlan struct {
	keys      []string
	numTokens int
	sbs       int
	aligned   int
	groups    []lookupGroup
	// partial is set under partial hash hits (Model.PartialHashHits): every
	// group's unit is one hash block (local[i] is hash i's slot), hits land
	// on hash-block boundaries and specs drive the evaluation.
	partial bool
	hbs     int
	specs   []lookupSpec
}

// lookupSpec is one of vLLM's spec groups: the groups of one identical spec,
// which hit only where all of them do (coordinator.py
// ExternalCachedBlockPool.get_cached_block).
type lookupSpec struct {
	ids  []int
	full bool
	bs   int
}

// TailKey names the token boundary whose hash keys a group's last loaded
// chunk: the hit itself, or, under partial hash hits, a later hash boundary
// of the same block where the group stored that block (worker.py
// MooncakeStoreWorker._tail_key_boundaries, data.py TailKeyBoundary).
type TailKey struct {
	// Group is the KV-group index.
	Group int `json:"group"`
	// Tokens is the boundary, a multiple of the hash block size.
	Tokens int `json:"tokens"`
}

// lookupGroup is one KV group's share of a plan.
type lookupGroup struct {
	group Group
	// prefix is set for full attention and MLA: a missing chunk stops every
	// longer hit, so evaluation can end there.
	prefix bool
	// chunks are the group's candidate chunks, ascending.
	chunks []Chunk
	// local[i] is chunk i's position among the group's distinct hashes.
	local []int32
	// The key of chunk i on rank r is keys[base + r*stride + local[i]].
	base, stride, ranks int
}

// lookupCursor walks one group's chunks while Hit walks the candidates.
type lookupCursor struct {
	next    int
	missing bool
	last    Chunk // the last missing chunk seen, when missing
}

// PlanLookup plans the lookup of a request of numTokens prompt tokens whose
// hash chain (at m.HashBlockSize) is hashes. The token count is aligned down
// to the scheduler block size; every multiple h of it up to there is a
// candidate hit (vLLM aligns lookups the same way without partial hash hits,
// which Model.Validate refuses). Each group contributes the chunks it needs
// at some candidate (Group.Reaches), each in every store namespace of
// Model.Namespaces; the hit is then the longest candidate every group
// reaches fully, as vLLM's MooncakeStoreCoordinator._find_hit_blocks
// converges to. A request shorter than one scheduler block gets a plan with
// no keys (and no hit).
//
// With partial hash hits (Model.PartialHashHits) the token count is aligned
// down to the hash block instead, every group is asked for every hash block
// (worker.py MooncakeStoreWorker.lookup, fine_grained) and hits land on hash
// boundaries (hitPartial); a request shorter than one hash block has no keys.
//
// Every key is in kb's tenant's key space (KeyBuilder.Tenant): a tenant
// only ever hits its own keys. A bad tenant is an ErrBadTenant error.
func PlanLookup(m *Model, kb KeyBuilder, hashes []BlockHash, numTokens int) (*LookupPlan, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	if err := ValidateTenant(kb.Tenant); err != nil {
		return nil, fmt.Errorf("lookup: %w", err)
	}
	if numTokens < 0 {
		return nil, fmt.Errorf("lookup of %d tokens: %w", numTokens, ErrNegativeCount)
	}
	sbs := m.SchedulerBlockSize()
	align := m.HitAlignment()
	p := &LookupPlan{numTokens: numTokens, sbs: sbs, aligned: numTokens / align * align, partial: m.PartialHashHits(), hbs: m.HashBlockSize}
	if p.aligned == 0 {
		return p, nil
	}
	nh := p.aligned / m.HashBlockSize
	if len(hashes) < nh {
		return nil, fmt.Errorf("lookup of %d tokens: %d block hashes, need %d: %w", numTokens, len(hashes), nh, ErrShortHashChain)
	}
	chain := chainPool.Get().(*hexChain)
	defer chainPool.Put(chain)
	if err := chain.reset(hashes[:nh]); err != nil {
		return nil, fmt.Errorf("lookup of %d tokens: %w", numTokens, err)
	}
	p.groups = make([]lookupGroup, len(m.Groups))
	distinct := make([][]int32, len(m.Groups))
	seen := chain.seen
	nkeys := 0
	if p.partial {
		p.specs = planSpecs(m)
	}
	for g, grp := range m.Groups {
		if p.partial {
			p.groups[g], distinct[g] = planGroupPartial(grp, chain.canon, seen)
		} else {
			p.groups[g], distinct[g] = p.planGroup(grp, m.HashBlockSize, chain.canon, seen)
		}
		p.groups[g].base = nkeys
		p.groups[g].ranks = len(m.Namespaces(g))
		nkeys += p.groups[g].ranks * p.groups[g].stride
	}
	p.keys = p.writeKeys(m, kb, chain, distinct, nkeys)
	return p, nil
}

// planGroup picks the chunks group g needs at some candidate hit. A chunk is
// needed iff the group reaches it from the first candidate at or after its
// end: for every kind, a later candidate reaches no more of the past.
// seen is scratch space of one entry per hash, cleared here.
func (p *LookupPlan) planGroup(g Group, hashBS int, canon, seen []int32) (lookupGroup, []int32) {
	clear(seen)
	lg := lookupGroup{group: g, prefix: g.Kind == KindFullAttention || g.Kind == KindMLA}
	lg.chunks = make([]Chunk, 0, p.aligned/g.BlockSize)
	lg.local = make([]int32, 0, p.aligned/g.BlockSize)
	var distinct []int32
	for end := g.BlockSize; end <= p.aligned; end += g.BlockSize {
		c := Chunk{Start: end - g.BlockSize, End: end}
		if !g.Reaches(c, ceilTo(end, p.sbs)) {
			continue
		}
		h := canon[c.HashIndex(hashBS)]
		if seen[h] == 0 {
			distinct = append(distinct, h)
			seen[h] = int32(len(distinct))
		}
		lg.chunks = append(lg.chunks, c)
		lg.local = append(lg.local, seen[h]-1)
	}
	lg.stride = len(distinct)
	return lg, distinct
}

// planGroupPartial plans a group under partial hash hits: vLLM's fine-grained
// MooncakeStoreWorker.lookup asks every group for every hash block of the
// aligned prompt, in every namespace (worker.py, lookup_masks None).
func planGroupPartial(g Group, canon, seen []int32) (lookupGroup, []int32) {
	clear(seen)
	lg := lookupGroup{group: g, prefix: g.Kind == KindFullAttention || g.Kind == KindMLA}
	lg.local = make([]int32, len(canon))
	var distinct []int32
	for i, h := range canon {
		if seen[h] == 0 {
			distinct = append(distinct, h)
			seen[h] = int32(len(distinct))
		}
		lg.local[i] = seen[h] - 1
	}
	lg.stride = len(distinct)
	return lg, distinct
}

// planSpecs merges identical groups into vLLM's spec groups, in order of
// first appearance, full attention and MLA first (coordinator.py
// MooncakeStoreCoordinator._verify_and_split_kv_cache_groups; MLA's spec is
// a FullAttentionSpec).
func planSpecs(m *Model) []lookupSpec {
	var specs []lookupSpec
	var keys []Group
	for g, grp := range m.Groups {
		j := slices.Index(keys, grp)
		if j < 0 {
			keys = append(keys, grp)
			specs = append(specs, lookupSpec{full: grp.Kind == KindFullAttention || grp.Kind == KindMLA, bs: grp.BlockSize})
			j = len(specs) - 1
		}
		specs[j].ids = append(specs[j].ids, g)
	}
	slices.SortStableFunc(specs, func(a, b lookupSpec) int {
		switch {
		case a.full && !b.full:
			return -1
		case !a.full && b.full:
			return 1
		}
		return 0
	})
	return specs
}

// writeKeys writes every key into one string and slices the keys out of it:
// a plan of thousands of keys costs a handful of allocations.
func (p *LookupPlan) writeKeys(m *Model, kb KeyBuilder, chain *hexChain, distinct [][]int32, nkeys int) []string {
	namespaces := make([][]string, len(m.Groups))
	size := 0
	for g := range m.Groups {
		hexLen := 0
		for _, h := range distinct[g] {
			hexLen += len(chain.at(h))
		}
		for _, r := range m.Namespaces(g) {
			ns := kb.Namespace(r, g)
			namespaces[g] = append(namespaces[g], ns)
			size += len(distinct[g])*(len(ns)+1) + hexLen
		}
	}
	var sb strings.Builder
	sb.Grow(size)
	for g, nss := range namespaces {
		for _, ns := range nss {
			for _, h := range distinct[g] {
				sb.WriteString(ns)
				sb.WriteByte(keySep)
				sb.Write(chain.at(h))
			}
		}
	}
	all := sb.String()
	keys := make([]string, 0, nkeys)
	off := 0
	for g, nss := range namespaces {
		for _, ns := range nss {
			for _, h := range distinct[g] {
				n := len(ns) + 1 + len(chain.at(h))
				keys = append(keys, all[off:off+n])
				off += n
			}
		}
	}
	return keys
}

// hexChain is a hash chain in hex, with duplicates folded: canon[i] is the
// first index whose hash equals hash i. It is scratch space of PlanLookup
// (the keys copy the hex), kept in chainPool between lookups so that a
// lookup of thousands of hashes allocates none of it.
type hexChain struct {
	// hex holds every hash's hex, back to back: hash i's is
	// hex[off[i]:off[i+1]].
	hex   []byte
	off   []int32
	canon []int32
	// table is the open-addressing table of reset; seen the planners'
	// scratch, one entry per hash.
	table []int32
	seen  []int32
}

// chainPool keeps hexChains between lookups.
var chainPool = sync.Pool{New: func() any { return new(hexChain) }}

// chainSeed seeds the hashing of reset's table, once per process, so that
// no chain can be made to collide in it on purpose.
var chainSeed = maphash.MakeSeed()

// at is hash i's hex.
func (c *hexChain) at(i int32) []byte { return c.hex[c.off[i]:c.off[i+1]] }

// reset makes c the chain of hashes: their hex, and canon through an
// open-addressing table of the hashes' maphash. The table is hand-written
// because a Go map needs string keys: the hashes' bytes would be copied
// into a string each (or the hex be made strings), for a table that lives
// for one lookup.
func (c *hexChain) reset(hashes []BlockHash) error {
	size := 0
	for i, h := range hashes {
		if len(h) == 0 {
			return fmt.Errorf("block hash %d: %w", i, ErrEmptyHash)
		}
		size += 2 * len(h)
	}
	n := len(hashes)
	c.hex = slices.Grow(c.hex[:0], size)[:size]
	c.off = slices.Grow(c.off[:0], n+1)[:n+1]
	c.canon = slices.Grow(c.canon[:0], n)[:n]
	c.seen = slices.Grow(c.seen[:0], n)[:n]
	tableLen := 1 << bits.Len(uint(2*n))
	c.table = slices.Grow(c.table[:0], tableLen)[:tableLen]
	clear(c.table)
	mask := tableLen - 1
	off := 0
	for i, h := range hashes {
		c.off[i] = int32(off)
		encodeHex(c.hex[off:off+2*len(h)], h)
		off += 2 * len(h)
		c.canon[i] = c.fold(hashes, i, int(maphash.Bytes(chainSeed, h))&mask, mask)
	}
	c.off[n] = int32(off)
	return nil
}

// fold returns the first index of hashes whose hash equals hashes[i],
// probing the table from slot, and enters i when it is the first. A slot
// holds 1 + an index, 0 when empty.
func (c *hexChain) fold(hashes []BlockHash, i, slot, mask int) int32 {
	for {
		j := c.table[slot]
		if j == 0 {
			c.table[slot] = int32(i + 1)
			return int32(i)
		}
		if bytes.Equal(hashes[j-1], hashes[i]) {
			return j - 1
		}
		slot = (slot + 1) & mask
	}
}

// Keys are the keys to check, deduplicated, in one batch. Callers must not
// modify the slice. An empty list means there is nothing to look up.
func (p *LookupPlan) Keys() []string { return p.keys }

// NumTokens is the request's prompt token count the plan was built for.
func (p *LookupPlan) NumTokens() int { return p.numTokens }

// Hit returns the longest candidate h ≤ limitTokens such that every group
// finds, in every rank namespace, every chunk it needs at h. exists[i]
// answers Keys()[i]; a missing answer counts as absent. The result is a
// multiple of the scheduler block size (of the hash block size with partial
// hash hits), at most limitTokens, and 0 when nothing hits.
func (p *LookupPlan) Hit(exists []bool, limitTokens int) int {
	if p.partial {
		return p.hitPartial(exists, limitTokens)
	}
	top := min(limitTokens, p.aligned)
	if top < p.sbs {
		return 0
	}
	var buf [8]lookupCursor
	cur := buf[:0]
	if len(p.groups) > len(buf) {
		cur = make([]lookupCursor, 0, len(p.groups))
	}
	cur = cur[:len(p.groups)]
	best := 0
	for h := p.sbs; h <= top; h += p.sbs {
		ok := true
		for i := range p.groups {
			g, c := &p.groups[i], &cur[i]
			g.advance(c, h, exists)
			if c.missing && g.group.Reaches(c.last, h) {
				if g.prefix {
					return best
				}
				ok = false
				break
			}
		}
		if ok {
			best = h
		}
	}
	return best
}

// advance moves c over the group's chunks ending at or before h, keeping the
// last missing one. Since a group reaches an earlier chunk only if it reaches
// every later one up to h, that chunk alone decides whether h is valid.
func (g *lookupGroup) advance(c *lookupCursor, h int, exists []bool) {
	for ; c.next < len(g.chunks) && g.chunks[c.next].End <= h; c.next++ {
		if !g.present(c.next, exists) {
			c.missing, c.last = true, g.chunks[c.next]
		}
	}
}

// present reports whether chunk i is in every rank namespace.
func (g *lookupGroup) present(i int, exists []bool) bool {
	for r := 0; r < g.ranks; r++ {
		slot := g.base + r*g.stride + int(g.local[i])
		if slot >= len(exists) || !exists[slot] {
			return false
		}
	}
	return true
}

// hitPartial is Hit under partial hash hits, as vLLM's
// MooncakeStoreCoordinator._find_hit_blocks with alignment_tokens =
// hash_block_size has it (coordinator.py): each full-attention spec is
// found once, on the length left by the specs before it, and then caps the
// hit; the other specs are found again on the shrinking length until it
// stops shrinking (one pass for a full-plus-one hybrid). The result is a
// multiple of the hash block size, at most limitTokens.
func (p *LookupPlan) hitPartial(exists []bool, limitTokens int) int {
	top := min(limitTokens, p.aligned) / p.hbs * p.hbs
	if top < p.hbs {
		return 0
	}
	var buf [8]int
	fullHit := buf[:0]
	if len(p.specs) > len(buf) {
		fullHit = make([]int, 0, len(p.specs))
	}
	fullHit = fullHit[:len(p.specs)]
	for i := range fullHit {
		fullHit[i] = -1
	}
	simple := len(p.specs) == 2 && p.specs[0].full
	hit := top
	for {
		curr := hit
		for k, sp := range p.specs {
			if sp.full {
				if fullHit[k] < 0 {
					fullHit[k] = p.findFull(sp, curr, exists)
				}
				curr = min(curr, fullHit[k])
				continue
			}
			curr = p.findState(sp, curr, exists)
		}
		if curr >= hit {
			return hit
		}
		hit = curr
		if simple {
			return hit
		}
	}
}

// specPresent reports whether every group of the spec has hash block i in
// every namespace.
func (p *LookupPlan) specPresent(sp lookupSpec, i int, exists []bool) bool {
	for _, g := range sp.ids {
		if !p.groups[g].present(i, exists) {
			return false
		}
	}
	return true
}

// findFull is FullAttentionManager.find_longest_cache_hit in fine-grained
// mode (vllm/v1/core/single_type_kv_cache_manager.py): the run of whole
// blocks present from the start (each keyed by its last hash block), then
// the longest hash boundary present inside the first block that is not,
// probed high to low; at most maxLen.
func (p *LookupPlan) findFull(sp lookupSpec, maxLen int, exists []bool) int {
	k := sp.bs / p.hbs
	nh := p.aligned / p.hbs
	n := 0
	for n < maxLen/sp.bs && p.specPresent(sp, (n+1)*k-1, exists) {
		n++
	}
	hi := min(n*k+k-1, maxLen/p.hbs, nh)
	for i := hi - 1; i >= n*k; i-- {
		if p.specPresent(sp, i, exists) {
			return (i + 1) * p.hbs
		}
	}
	return n * sp.bs
}

// findState is MambaManager.find_longest_cache_hit in fine-grained mode:
// the longest hash boundary at most maxLen whose state is present.
func (p *LookupPlan) findState(sp lookupSpec, maxLen int, exists []bool) int {
	for i := min(maxLen/p.hbs, p.aligned/p.hbs) - 1; i >= 0; i-- {
		if p.specPresent(sp, i, exists) {
			return (i + 1) * p.hbs
		}
	}
	return 0
}

// TailKeys returns, for a hit the plan resolved from exists, the boundary
// whose hash keys each group's last chunk, as vLLM's
// MooncakeStoreWorker._tail_key_boundaries (worker.py) has it: the hit when
// the group has its hash, else the first later hash boundary of the hit's
// block that the group has (a sub-block hit inside a block stored whole or
// under a longer prompt tail). No keys for a hit of 0. Without partial hash
// hits every group has the hit's hash, so every boundary is the hit. A group
// with no such boundary (never for a hit Resolve returned from the same
// answers) is an ErrChunkOutOfRange error, where vLLM's assertion fails.
func (p *LookupPlan) TailKeys(exists []bool, hit int) ([]TailKey, error) {
	if len(exists) != len(p.keys) {
		return nil, fmt.Errorf("tail keys: %d answers for %d keys: %w", len(exists), len(p.keys), ErrAnswerCount)
	}
	if hit <= 0 {
		return nil, nil
	}
	out := make([]TailKey, len(p.groups))
	for g := range p.groups {
		out[g] = TailKey{Group: g, Tokens: hit}
		if !p.partial {
			continue
		}
		lg := &p.groups[g]
		bs := lg.group.BlockSize
		hi := hit/p.hbs - 1
		if hi >= len(lg.local) {
			return nil, fmt.Errorf("tail keys: hit %d past the %d planned hash blocks: %w", hit, len(lg.local), ErrChunkOutOfRange)
		}
		if lg.present(hi, exists) {
			continue
		}
		next := min(((hit+bs-1)/bs)*bs/p.hbs, len(lg.local))
		found := false
		for i := hi + 1; i < next; i++ {
			if lg.present(i, exists) {
				out[g].Tokens = (i + 1) * p.hbs
				found = true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("tail keys: group %d has no stored key for the block holding hit %d: %w", g, hit, ErrChunkOutOfRange)
		}
	}
	return out, nil
}

// Resolve turns the store's answers into the request's hit, applying the
// full-hit rule as vLLM's MooncakeStoreWorker.lookup has it (worker.py of
// the MooncakeStore connector): a hit covering every prompt token is
// re-derived, from the same answers, at num_tokens − 1 aligned down to the
// scheduler block size (the hash block size with partial hash hits), so the engine computes at least the last token (an
// aligned prompt gives up a whole scheduler block); nothing when that
// alignment is 0.
func (p *LookupPlan) Resolve(exists []bool) (int, error) {
	if len(exists) != len(p.keys) {
		return 0, fmt.Errorf("lookup: %d answers for %d keys: %w", len(exists), len(p.keys), ErrAnswerCount)
	}
	if !p.partial {
		// Without partial hash hits, whether a candidate is valid does not
		// depend on the limit, so Hit(n) is the largest valid candidate up
		// to n; re-deriving at n − 1 when n itself is valid gives the same
		// as asking at n − 1 straight away: one pass over the answers.
		return p.Hit(exists, p.numTokens-1), nil
	}
	hit := p.Hit(exists, p.numTokens)
	if hit >= p.numTokens && hit > 0 {
		hit = p.Hit(exists, p.numTokens-1)
	}
	return hit, nil
}

// Decide turns a hit into the connector's answer, as vLLM's
// MooncakeStoreScheduler.get_num_new_matched_tokens (scheduler.py): need =
// hit − numComputedTokens external tokens, loaded asynchronously when
// loadAsync.
// need ≤ 0 gives 0 and no LoadSpec; otherwise the LoadSpec is
// {numComputedTokens, hit, can_load=false} (allocation sets CanLoad).
func Decide(hit, numComputedTokens int, loadAsync bool) (need int, spec *LoadSpec, async bool) {
	need = hit - numComputedTokens
	if need <= 0 {
		return 0, nil, false
	}
	return need, &LoadSpec{VLLMCachedTokens: numComputedTokens, KVPoolCachedTokens: hit}, loadAsync
}

// ceilTo rounds x up to a multiple of m.
func ceilTo(x, m int) int { return (x + m - 1) / m * m }
