package kvcore

import "fmt"

// Score is what a source (the store pool, or one engine's prefix cache)
// holds of a prompt, seen the way a hybrid-aware scheduler sees it and the
// way a router that folds KV-cache groups together sees it.
type Score struct {
	// HitTokens is the hybrid longest hit: the prefix every group can serve
	// by its kind's rule, with vLLM's full-hit rule (a hit covering the
	// whole prompt is re-derived at num_tokens − 1), as LookupPlan.Resolve
	// has it. It is what the lookup's store child finds usable, before the
	// engine's computed tokens are subtracted.
	HitTokens int
	// AnyGroupPrefixTokens is the longest prefix every token of which lies
	// in a block that at least one group holds: what a router that folds
	// every group into one key counts. It is never less than a group's
	// PrefixTokens; AnyGroupPrefixTokens − HitTokens is its over-count.
	AnyGroupPrefixTokens int
	// Groups are the groups' own counts, in group-index order.
	Groups []GroupScore
}

// GroupScore is one KV-cache group's view of a prompt, counted in whole
// blocks of the group from token 0, none of them cut by the full-hit rule.
type GroupScore struct {
	// Group is the group index.
	Group int
	// Kind is the group's attention kind.
	Kind Kind
	// BlockSize is the group's block size in tokens.
	BlockSize int
	// PrefixTokens is the longest run of the group's blocks held from token
	// 0: what a router that sees only this group counts.
	PrefixTokens int
	// UsableTokens is the longest hit this group alone could serve by its
	// kind's rule (Group.Reaches): PrefixTokens for full attention and MLA;
	// for a sliding window, the longest h whose window blocks before h are
	// held; for Mamba, the longest h whose state is held. Under partial
	// hash hits (Model.PartialHashHits) a full-attention or Mamba hit may
	// end inside a block, on a hash-block boundary, as vLLM's fine-grained
	// managers find it.
	UsableTokens int
}

// BlockPresence reports whether a source holds group's block keyed by
// hash (the hash at the block's end, as store keys and vLLM's KV events
// name it).
type BlockPresence func(group int, hash BlockHash) bool

// ScorePlan is the scoring of one prompt: the keys of every block of every
// group in every store namespace (the lookup's keys among them), checked in
// one batch, and what turns the answers into a Score. Build it with
// PlanScore; it is not modified afterwards.
type ScorePlan struct {
	model     *Model
	numTokens int
	hashes    []BlockHash
	lookup    *LookupPlan
	keys      []string
	// gather[i] is the index in keys of the lookup plan's key i.
	gather []int32
	groups []scoreGroup
}

// scoreGroup is one group's share of a score plan.
type scoreGroup struct {
	// step is the distance between the group's keyed boundaries: its block
	// size, or the hash block size under partial hash hits.
	step int
	// slots[r][k] is the index in keys of the block ending at (k+1)·step
	// in the group's namespace r.
	slots [][]int32
}

// PlanScore plans the scoring of a prompt of numTokens tokens whose hash
// chain (at m.HashBlockSize) is hashes, in kb's tenant's key space: every
// block of every group up to numTokens, in every namespace of the group
// (Model.Namespaces), and, under partial hash hits, every hash-block
// boundary (where vLLM keys sub-block tails). The keys are deduplicated
// and include every key of the request's LookupPlan, so that one batch
// answers both the lookup's hit and the groups' counts.
func PlanScore(m *Model, kb KeyBuilder, hashes []BlockHash, numTokens int) (*ScorePlan, error) {
	lp, err := PlanLookup(m, kb, hashes, numTokens)
	if err != nil {
		return nil, fmt.Errorf("score: %w", err)
	}
	nh := numTokens / m.HashBlockSize
	if len(hashes) < nh {
		return nil, fmt.Errorf("score of %d tokens: %d block hashes, need %d: %w", numTokens, len(hashes), nh, ErrShortHashChain)
	}
	for i, h := range hashes[:nh] {
		if len(h) == 0 {
			return nil, fmt.Errorf("score: block hash %d: %w", i, ErrEmptyHash)
		}
	}
	p := &ScorePlan{model: m, numTokens: numTokens, hashes: hashes[:nh], lookup: lp, groups: make([]scoreGroup, len(m.Groups))}
	index := map[string]int32{}
	for g := range m.Groups {
		p.groups[g] = p.planGroup(kb, g, index)
	}
	p.gather = make([]int32, len(lp.Keys()))
	for i, k := range lp.Keys() {
		j, ok := index[k]
		if !ok {
			return nil, fmt.Errorf("score: lookup key %s: %w", k, ErrUnplannedKey)
		}
		p.gather[i] = j
	}
	return p, nil
}

// planGroup adds group g's keys, deduplicated through index.
func (p *ScorePlan) planGroup(kb KeyBuilder, g int, index map[string]int32) scoreGroup {
	sg := scoreGroup{step: p.model.Groups[g].BlockSize}
	if p.model.PartialHashHits() {
		sg.step = p.model.HashBlockSize
	}
	n := p.numTokens / sg.step
	for _, r := range p.model.Namespaces(g) {
		slots := make([]int32, n)
		for k := range slots {
			key := kb.Key(r, g, p.hashAt((k+1)*sg.step))
			j, ok := index[key]
			if !ok {
				j = int32(len(p.keys))
				index[key] = j
				p.keys = append(p.keys, key)
			}
			slots[k] = j
		}
		sg.slots = append(sg.slots, slots)
	}
	return sg
}

// hashAt is the hash keying the block that ends at token end.
func (p *ScorePlan) hashAt(end int) BlockHash { return p.hashes[end/p.model.HashBlockSize-1] }

// Keys are the keys to check, deduplicated, in one batch. Callers must not
// modify the slice. An empty list means nothing to check (a prompt shorter
// than every group's block).
func (p *ScorePlan) Keys() []string { return p.keys }

// Score turns the store's answers into the prompt's score: exists[i]
// answers Keys()[i]. A block counts for a group only when every namespace
// of the group holds it. Answers that do not match the keys one for one
// are an ErrAnswerCount error.
func (p *ScorePlan) Score(exists []bool) (Score, error) {
	if len(exists) != len(p.keys) {
		return Score{}, fmt.Errorf("score: %d answers for %d keys: %w", len(exists), len(p.keys), ErrAnswerCount)
	}
	lookup := make([]bool, len(p.gather))
	for i, j := range p.gather {
		lookup[i] = exists[j]
	}
	hit, err := p.lookup.Resolve(lookup)
	if err != nil {
		return Score{}, fmt.Errorf("score: %w", err)
	}
	has := func(g, end int) bool {
		sg := &p.groups[g]
		for _, slots := range sg.slots {
			if !exists[slots[end/sg.step-1]] {
				return false
			}
		}
		return true
	}
	s := Score{HitTokens: hit, Groups: make([]GroupScore, len(p.model.Groups))}
	for g := range p.model.Groups {
		s.Groups[g] = p.scoreGroup(g, has)
	}
	s.AnyGroupPrefixTokens = anyGroupPrefix(p.model, p.numTokens, has)
	return s, nil
}

// ScorePresence scores the prompt against a source that answers per block
// rather than per store key (an engine's own prefix cache, known from its
// KV events): it has no namespaces, so a block held is held in all of
// them. The rules are Score's.
func (p *ScorePlan) ScorePresence(has BlockPresence) Score {
	exists := make([]bool, len(p.keys))
	for g, sg := range p.groups {
		for _, slots := range sg.slots {
			for k, j := range slots {
				exists[j] = has(g, p.hashAt((k+1)*sg.step))
			}
		}
	}
	s, _ := p.Score(exists) // exists answers every key: Score cannot fail
	return s
}

// scoreGroup counts group g's prefix and usable tokens; has(g, end)
// reports the block (or, under partial hash hits, the hash boundary)
// ending at end.
func (p *ScorePlan) scoreGroup(g int, has func(g, end int) bool) GroupScore {
	grp := p.model.Groups[g]
	gs := GroupScore{Group: g, Kind: grp.Kind, BlockSize: grp.BlockSize}
	bs := grp.BlockSize
	for gs.PrefixTokens+bs <= p.numTokens && has(g, gs.PrefixTokens+bs) {
		gs.PrefixTokens += bs
	}
	if p.model.PartialHashHits() {
		gs.UsableTokens = usablePartial(grp, gs.PrefixTokens, p.numTokens, p.model.HashBlockSize, func(end int) bool { return has(g, end) })
	} else {
		gs.UsableTokens = usable(grp, p.numTokens, func(end int) bool { return has(g, end) })
	}
	return gs
}

// usable is the longest h, a multiple of the group's block size at most
// numTokens, at which every block the group reaches (Group.Reaches) is
// held: the last block missing so far alone decides, since a group that
// reaches a block reaches every later one up to h.
func usable(grp Group, numTokens int, has func(end int) bool) int {
	bs := grp.BlockSize
	best := 0
	missing, last := false, Chunk{}
	for h := bs; h <= numTokens; h += bs {
		if !has(h) {
			missing, last = true, Chunk{Start: h - bs, End: h}
		}
		if !missing || !grp.Reaches(last, h) {
			best = h
		}
	}
	return best
}

// usablePartial is usable under partial hash hits, where hits land on
// hash-block boundaries: full attention and MLA hold their whole-block
// prefix and then the longest boundary held inside the next block
// (FullAttentionManager's fine-grained find_longest_cache_hit); Mamba the
// longest boundary whose state is held (MambaManager's).
func usablePartial(grp Group, prefix, numTokens, hbs int, has func(end int) bool) int {
	top := numTokens / hbs * hbs
	if grp.Kind == KindMamba {
		for h := top; h > 0; h -= hbs {
			if has(h) {
				return h
			}
		}
		return 0
	}
	for h := min(prefix+grp.BlockSize-hbs, top); h > prefix; h -= hbs {
		if has(h) {
			return h
		}
	}
	return prefix
}

// anyGroupPrefix is the longest prefix whose every token lies in a whole
// block that some group holds: from T, the prefix grows to the furthest
// end of a held block containing token T, until no group holds one.
func anyGroupPrefix(m *Model, numTokens int, has func(g, end int) bool) int {
	t := 0
	for {
		next := t
		for g, grp := range m.Groups {
			end := t/grp.BlockSize*grp.BlockSize + grp.BlockSize
			if end > next && end <= numTokens && has(g, end) {
				next = end
			}
		}
		if next == t {
			return t
		}
		t = next
	}
}
