package kvcore

// Probe chooses, for a store of two tiers, which keys the lower tier is
// asked about next. found[i] says Keys()[i] is known present (in the upper
// tier or confirmed below), tried[i] that the lower tier was already asked
// (and did not confirm it). It returns the indices to ask next, none when
// asking more cannot change the hit.
//
// Without it every key the upper tier lacks would be asked about, one
// round trip each: for a prompt the store has never seen, as many as the
// prompt has blocks. Full-attention and MLA groups reach a hit only through
// an unbroken run of chunks from the start, so they are probed in chain
// order, first chunk after the known run first, in windows that double
// from window (a prompt the tier lacks costs one small round); the first
// chunk the lower tier does not hold ends the group's run, and with it
// every longer candidate. The other groups' chunks are then asked about
// only up to the shortest run's end: no key past it can make a hit. Under
// partial hash hits, where the runs are judged at block boundaries only,
// every key not known is asked about at once.
func (p *LookupPlan) Probe(found, tried []bool, window int) []int {
	if len(found) != len(p.keys) || len(tried) != len(p.keys) {
		return nil
	}
	window = max(window, 1)
	if p.partial {
		return p.unknownUpTo(found, tried, p.aligned, func(*lookupGroup) bool { return true })
	}
	limit := p.aligned
	var next []int
	for g := range p.groups {
		lg := &p.groups[g]
		if !lg.prefix {
			continue
		}
		run, ask := p.probePrefix(lg, found, tried, window)
		next = append(next, ask...)
		limit = min(limit, run)
	}
	if len(next) > 0 {
		return dedupe(next)
	}
	return p.unknownUpTo(found, tried, limit, func(lg *lookupGroup) bool { return !lg.prefix })
}

// probePrefix walks prefix group lg's chunks in order: run is the end of
// its known run of present chunks (or, while unknown chunks remain, the
// end of what could still be present), ask the unknown slots of the next
// chunks, at most a window doubling with the known run's length.
func (p *LookupPlan) probePrefix(lg *lookupGroup, found, tried []bool, window int) (run int, ask []int) {
	known := 0
	for i, c := range lg.chunks {
		if lg.present(i, found) {
			known = c.End
			continue
		}
		if p.triedAbsent(lg, i, found, tried) {
			return known, nil
		}
		n := max(window, i) // doubles: the window grows with the run already confirmed
		for j := i; j < len(lg.chunks) && j < i+n; j++ {
			ask = append(ask, p.unknownSlots(lg, j, found, tried)...)
		}
		return p.aligned, ask
	}
	return known, nil
}

// triedAbsent reports whether chunk i of lg has a slot that is neither
// found nor untried: the lower tier was asked and does not hold it.
func (p *LookupPlan) triedAbsent(lg *lookupGroup, i int, found, tried []bool) bool {
	for r := range lg.ranks {
		slot := lg.base + r*lg.stride + int(lg.local[i])
		if !found[slot] && tried[slot] {
			return true
		}
	}
	return false
}

// unknownSlots lists chunk i's slots that are neither found nor tried.
func (p *LookupPlan) unknownSlots(lg *lookupGroup, i int, found, tried []bool) []int {
	var out []int
	for r := range lg.ranks {
		slot := lg.base + r*lg.stride + int(lg.local[i])
		if !found[slot] && !tried[slot] {
			out = append(out, slot)
		}
	}
	return out
}

// unknownUpTo lists the unknown slots of the chosen groups' units that end
// at or before limit tokens.
func (p *LookupPlan) unknownUpTo(found, tried []bool, limit int, chosen func(*lookupGroup) bool) []int {
	var out []int
	for g := range p.groups {
		lg := &p.groups[g]
		if !chosen(lg) {
			continue
		}
		for i := range lg.local {
			if p.unitEnd(lg, i) > limit {
				break
			}
			out = append(out, p.unknownSlots(lg, i, found, tried)...)
		}
	}
	return dedupe(out)
}

// unitEnd is the token end of unit i of lg: its chunk's, or under partial
// hash hits its hash block's.
func (p *LookupPlan) unitEnd(lg *lookupGroup, i int) int {
	if p.partial {
		return (i + 1) * p.hbs
	}
	return lg.chunks[i].End
}

// dedupe drops repeated indices (two chunks of one hash share a slot),
// keeping the first of each.
func dedupe(idx []int) []int {
	seen := make(map[int]bool, len(idx))
	out := idx[:0]
	for _, i := range idx {
		if !seen[i] {
			seen[i] = true
			out = append(out, i)
		}
	}
	return out
}
