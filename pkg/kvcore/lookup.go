package kvcore

import (
	"fmt"
	"strings"
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
// candidate hit. Each group contributes the chunks it needs at some candidate
// (Group.Reaches), each in every store namespace of Model.Namespaces. A request
// shorter than one scheduler block gets a plan with no keys (and no hit).
func PlanLookup(m *Model, kb KeyBuilder, hashes []BlockHash, numTokens int) (*LookupPlan, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	if numTokens < 0 {
		return nil, fmt.Errorf("lookup of %d tokens: %w", numTokens, ErrNegativeCount)
	}
	sbs := m.SchedulerBlockSize()
	p := &LookupPlan{numTokens: numTokens, sbs: sbs, aligned: numTokens / sbs * sbs}
	if p.aligned == 0 {
		return p, nil
	}
	nh := p.aligned / m.HashBlockSize
	if len(hashes) < nh {
		return nil, fmt.Errorf("lookup of %d tokens: %d block hashes, need %d: %w", numTokens, len(hashes), nh, ErrShortHashChain)
	}
	chain, err := newHexChain(hashes[:nh])
	if err != nil {
		return nil, fmt.Errorf("lookup of %d tokens: %w", numTokens, err)
	}
	p.groups = make([]lookupGroup, len(m.Groups))
	distinct := make([][]int32, len(m.Groups))
	seen := make([]int32, nh)
	nkeys := 0
	for g, grp := range m.Groups {
		p.groups[g], distinct[g] = p.planGroup(grp, m.HashBlockSize, chain.canon, seen)
		p.groups[g].base = nkeys
		p.groups[g].ranks = len(m.Namespaces(g))
		nkeys += p.groups[g].ranks * p.groups[g].stride
	}
	p.keys = p.writeKeys(m, kb, chain.hex, distinct, nkeys)
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

// writeKeys writes every key into one string and slices the keys out of it:
// a plan of thousands of keys costs a handful of allocations.
func (p *LookupPlan) writeKeys(m *Model, kb KeyBuilder, hexes []string, distinct [][]int32, nkeys int) []string {
	namespaces := make([][]string, len(m.Groups))
	size := 0
	for g := range m.Groups {
		hexLen := 0
		for _, h := range distinct[g] {
			hexLen += len(hexes[h])
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
				sb.WriteString(hexes[h])
			}
		}
	}
	all := sb.String()
	keys := make([]string, 0, nkeys)
	off := 0
	for g, nss := range namespaces {
		for _, ns := range nss {
			for _, h := range distinct[g] {
				n := len(ns) + 1 + len(hexes[h])
				keys = append(keys, all[off:off+n])
				off += n
			}
		}
	}
	return keys
}

// hexChain is a hash chain in hex, with duplicates folded: canon[i] is the
// first index whose hash equals hash i.
type hexChain struct {
	hex   []string
	canon []int32
}

func newHexChain(hashes []BlockHash) (hexChain, error) {
	size := 0
	for i, h := range hashes {
		if len(h) == 0 {
			return hexChain{}, fmt.Errorf("block hash %d: %w", i, ErrEmptyHash)
		}
		size += 2 * len(h)
	}
	var sb strings.Builder
	sb.Grow(size)
	for _, h := range hashes {
		writeHex(&sb, h)
	}
	all := sb.String()
	c := hexChain{hex: make([]string, len(hashes)), canon: make([]int32, len(hashes))}
	first := make(map[string]int32, len(hashes))
	off := 0
	for i, h := range hashes {
		s := all[off : off+2*len(h)]
		off += len(s)
		c.hex[i] = s
		j, dup := first[s]
		if !dup {
			j = int32(i)
			first[s] = j
		}
		c.canon[i] = j
	}
	return c, nil
}

// Keys are the keys to check, deduplicated, in one batch. Callers must not
// modify the slice. An empty list means there is nothing to look up.
func (p *LookupPlan) Keys() []string { return p.keys }

// NumTokens is the request's prompt token count the plan was built for.
func (p *LookupPlan) NumTokens() int { return p.numTokens }

// Hit returns the longest candidate h ≤ limitTokens such that every group
// finds, in every rank namespace, every chunk it needs at h. exists[i]
// answers Keys()[i]; a missing answer counts as absent. The result is a
// multiple of the scheduler block size, at most limitTokens, and 0 when
// nothing hits.
func (p *LookupPlan) Hit(exists []bool, limitTokens int) int {
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

// Resolve turns the store's answers into the request's hit, applying the
// full-hit rule: a hit covering every prompt token is re-derived for one
// token less (the engine must compute at least one), from the same answers.
func (p *LookupPlan) Resolve(exists []bool) (int, error) {
	if len(exists) != len(p.keys) {
		return 0, fmt.Errorf("lookup: %d answers for %d keys: %w", len(exists), len(p.keys), ErrAnswerCount)
	}
	hit := p.Hit(exists, p.numTokens)
	if hit >= p.numTokens && hit > 0 {
		hit = p.Hit(exists, p.numTokens-1)
	}
	return hit, nil
}

// Decide turns a hit into the connector's answer: need = hit −
// numComputedTokens external tokens, loaded asynchronously when loadAsync.
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
