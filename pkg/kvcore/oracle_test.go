package kvcore

import (
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"strconv"
	"testing"
	"time"
)

// The property test of hit-rate parity: random hybrid workloads, with the
// store filled by the saves of earlier requests sharing prefixes (some
// preempted and resumed with more tokens), and kvmesh's save chunks, lookup
// hit, load chunks and connector answer compared with vlOracle, a direct
// transcription of vLLM's rules that shares no code with kvmesh:
//
//   - save: coordinator.py MooncakeStoreCoordinator.store_mask with each
//     manager's reachable_block_mask (retention None); Mamba through
//     worker.py _boundary_snapshot_puts, the state at each save's end;
//   - lookup: worker.py MooncakeStoreWorker.lookup (align to the scheduler
//     block size, full-hit re-derivation at num_tokens − 1),
//     coordinator.py _find_hit_blocks (the convergence loop) and the
//     managers' find_longest_cache_hit
//     (vllm/v1/core/single_type_kv_cache_manager.py);
//   - load: coordinator.py load_mask with data.py process_tokens;
//   - answer: scheduler.py get_num_new_matched_tokens.

// vlGroup is one KV-cache group as vLLM's spec has it.
type vlGroup struct {
	kind   string // "full", "mla", "swa", "mamba"
	bs     int
	window int
}

// vlOracle holds one layout and the store's (group, hash) entries.
type vlOracle struct {
	groups []vlGroup
	hbs    int
	lcm    int
	stored map[[2]string]bool // {group index, hash id}
}

func newVLOracle(groups []vlGroup, hbs int) *vlOracle {
	l := 1
	for _, g := range groups {
		a, b := l, g.bs
		for b != 0 {
			a, b = b, a%b
		}
		l = l / a * g.bs
	}
	return &vlOracle{groups: groups, hbs: hbs, lcm: l, stored: map[[2]string]bool{}}
}

func cdiv(a, b int) int { return (a + b - 1) / b }

// blockHash is the compact key hash of block i of group g (data.py
// _CompactChunkHashList: the block's last hash-block hash).
func (o *vlOracle) blockHash(hashes []string, g, i int) string {
	return hashes[(i+1)*o.groups[g].bs/o.hbs-1]
}

// storeMask is store_mask for one group: which blocks of [start, tokenLen)
// a save writes (block indices).
func (o *vlOracle) storeMask(g, start, tokenLen int) []int {
	grp := o.groups[g]
	end := tokenLen / grp.bs
	first := min(end, cdiv(start, grp.bs))
	var out []int
	switch grp.kind {
	case "mamba":
		// Masked out of the positional save; the boundary state of the step
		// (its end) is offloaded instead.
		if start < tokenLen {
			out = append(out, tokenLen/grp.bs-1)
		}
	case "swa":
		need := cdiv(grp.window-1, grp.bs)
		per := o.lcm / grp.bs
		for i := first; i < end; i++ {
			if need >= per || i%per >= per-need {
				out = append(out, i)
			}
		}
	default:
		for i := first; i < end; i++ {
			out = append(out, i)
		}
	}
	return out
}

// save stores the save of [start, tokenLen) of a request.
func (o *vlOracle) save(hashes []string, start, tokenLen int) {
	tokenLen = tokenLen / o.lcm * o.lcm
	for g := range o.groups {
		for _, i := range o.storeMask(g, start, tokenLen) {
			o.stored[[2]string{fmt.Sprint(g), o.blockHash(hashes, g, i)}] = true
		}
	}
}

func (o *vlOracle) cached(hashes []string, g, i int) bool {
	return o.stored[[2]string{fmt.Sprint(g), o.blockHash(hashes, g, i)}]
}

// find is a manager's find_longest_cache_hit (alignment lcm, no EAGLE):
// the hit length and, per block below it, whether the group loads it.
func (o *vlOracle) find(hashes []string, g, maxLen int, all bool) (int, []bool) {
	grp := o.groups[g]
	bs := grp.bs
	has := func(i int) bool { return all || o.cached(hashes, g, i) }
	n := maxLen / bs
	switch grp.kind {
	case "swa":
		need := cdiv(grp.window-1, bs)
		mask := make([]bool, n)
		run, found := 0, false
		for i := n - 1; i >= 0; i-- {
			if !has(i) {
				run = 0
				continue
			}
			if run == 0 && bs != o.lcm && (i+1)*bs%o.lcm != 0 {
				continue
			}
			mask[i] = true
			run++
			if run >= need {
				mask = mask[:i+run]
				found = true
				break
			}
		}
		if !found {
			mask = mask[:run]
			for len(mask)*bs%o.lcm != 0 {
				mask = mask[:len(mask)-1]
			}
		}
		return len(mask) * bs, mask
	case "mamba":
		for i := n - 1; i >= 0; i-- {
			if has(i) && (bs == o.lcm || (i+1)*bs%o.lcm == 0) {
				mask := make([]bool, i+1)
				mask[i] = true
				return (i + 1) * bs, mask
			}
		}
		return 0, nil
	default:
		k := 0
		for k < n && has(k) {
			k++
		}
		hit := k * bs
		hit -= hit % o.lcm
		mask := make([]bool, hit/bs)
		for i := range mask {
			mask[i] = true
		}
		return hit, mask
	}
}

// converge is _find_hit_blocks: spec groups (identical specs merged),
// full attention first and computed once, the others re-run on the
// shrinking length until it stops shrinking (one pass for a simple
// full-plus-one hybrid).
func (o *vlOracle) converge(hashes []string, maxLen int, all bool) (int, [][]bool) {
	type spec struct {
		g   vlGroup
		ids []int
	}
	var specs []spec
	for i, g := range o.groups {
		j := slices.IndexFunc(specs, func(s spec) bool { return s.g == g })
		if j < 0 {
			specs = append(specs, spec{g: g})
			j = len(specs) - 1
		}
		specs[j].ids = append(specs[j].ids, i)
	}
	isFull := func(k string) bool { return k == "full" || k == "mla" }
	slices.SortStableFunc(specs, func(a, b spec) int {
		switch {
		case isFull(a.g.kind) && !isFull(b.g.kind):
			return -1
		case !isFull(a.g.kind) && isFull(b.g.kind):
			return 1
		}
		return 0
	})
	// A merged spec hits only where every group of it does: run each group
	// and take the shortest, repeating until they agree.
	findSpec := func(s spec, l int) int {
		for {
			shortest := l
			for _, id := range s.ids {
				h, _ := o.find(hashes, id, l, all)
				shortest = min(shortest, h)
			}
			if shortest >= l {
				return l
			}
			l = shortest
		}
	}
	hit := maxLen
	fullHit := map[int]int{}
	simple := len(specs) == 2 && isFull(specs[0].g.kind)
	for {
		curr := hit
		for k, s := range specs {
			if isFull(s.g.kind) {
				if _, ok := fullHit[k]; !ok {
					fullHit[k] = findSpec(s, curr)
				}
				curr = min(curr, fullHit[k])
				continue
			}
			curr = findSpec(s, curr)
		}
		if curr >= hit {
			break
		}
		hit = curr
		if simple {
			break
		}
	}
	masks := make([][]bool, len(o.groups))
	for g := range o.groups {
		_, masks[g] = o.find(hashes, g, hit, all)
		if isFull(o.groups[g].kind) {
			masks[g] = masks[g][:hit/o.groups[g].bs]
		}
	}
	return hit, masks
}

// lookup is MooncakeStoreWorker.lookup: the hit of a request of numTokens.
func (o *vlOracle) lookup(hashes []string, numTokens int) int {
	tokenLen := numTokens / o.lcm * o.lcm
	if tokenLen <= 0 {
		return 0
	}
	hit, _ := o.converge(hashes, tokenLen, false)
	if hit >= numTokens {
		usable := (numTokens - 1) / o.lcm * o.lcm
		if usable <= 0 {
			return 0
		}
		hit, _ = o.converge(hashes, usable, false)
	}
	return hit
}

// loadChunks is what the receiving thread reads for a load to hit from
// vllm_cached tokens: process_tokens from floor(vllm_cached, lcm) filtered
// by load_mask.
func (o *vlOracle) loadChunks(hashes []string, g, vllmCached, hit int) []Chunk {
	_, masks := o.converge(hashes, hit, true)
	bs := o.groups[g].bs
	var out []Chunk
	for i := cdiv(vllmCached/o.lcm*o.lcm, bs); i < hit/bs; i++ {
		if i < len(masks[g]) && masks[g][i] {
			out = append(out, Chunk{Start: i * bs, End: (i + 1) * bs})
		}
	}
	return out
}

// matched is get_num_new_matched_tokens: the external tokens and whether a
// load spec is kept.
// checkDecide holds Decide's answer for a hit of kvmesh's to vLLM's for
// its own hit want (matched), failing case c on a difference, and returns
// the LoadSpec (nil when vLLM keeps none).
func checkDecide(t *testing.T, c, hit, computed, want int) *LoadSpec {
	t.Helper()
	need, spec, _ := Decide(hit, computed, true)
	wantNeed, keep := matched(want, computed)
	if need != wantNeed || (spec != nil) != keep {
		t.Fatalf("case %d: Decide(%d, %d) = %d, %v; vLLM %d, %v", c, hit, computed, need, spec, wantNeed, keep)
	}
	return spec
}

func matched(hit, computed int) (int, bool) {
	if hit < computed || hit-computed <= 0 {
		return 0, false
	}
	return hit - computed, true
}

// vlWorkload is one random case: a layout, earlier requests' saves and a
// request to look up.
type vlWorkload struct {
	groups []vlGroup
	hbs    int
}

func randomVLLayout(rng *rand.Rand) vlWorkload {
	hbs := []int{4, 8, 16}[rng.IntN(3)]
	cache := hbs * (1 + rng.IntN(3))
	withMamba := rng.IntN(2) == 0
	if withMamba {
		hbs = cache // a finer hash would turn on vLLM's partial hits
	}
	var groups []vlGroup
	groups = append(groups, vlGroup{kind: []string{"full", "mla"}[rng.IntN(2)], bs: cache})
	for range rng.IntN(3) {
		bs := hbs * (1 + rng.IntN(4))
		groups = append(groups, vlGroup{kind: "swa", bs: bs, window: 1 + rng.IntN(6*bs)})
	}
	if withMamba {
		groups = append(groups, vlGroup{kind: "mamba", bs: cache})
	}
	if rng.IntN(4) == 0 {
		groups = append(groups, groups[0]) // a second group of the same spec
	}
	rng.Shuffle(len(groups), func(i, j int) { groups[i], groups[j] = groups[j], groups[i] })
	return vlWorkload{groups: groups, hbs: hbs}
}

func (w vlWorkload) model() *Model {
	m := &Model{Name: "oracle", HashBlockSize: w.hbs}
	kinds := map[string]Kind{"full": KindFullAttention, "mla": KindMLA, "swa": KindSlidingWindow, "mamba": KindMamba}
	for _, g := range w.groups {
		m.Groups = append(m.Groups, Group{Kind: kinds[g.kind], BlockSize: g.bs, Window: g.window, BytesPerBlock: 1})
	}
	return m
}

// chain names the hash blocks of a request: shared ones up to diverge
// (in hash blocks) from the trunk, its own after.
func chain(owner, diverge, n int) []string {
	out := make([]string, n)
	for i := range out {
		if i < diverge {
			out[i] = fmt.Sprintf("%04x", i)
		} else {
			out[i] = fmt.Sprintf("%02x%04x", owner+1, i)
		}
	}
	return out
}

// stepEnds splits a prefill of n tokens into chunked-prefill saves: ends
// at random multiples of the scheduler block size, the last at floor(n).
func stepEnds(rng *rand.Rand, n, sbs int) []int {
	var ends []int
	last := n / sbs * sbs
	for e := 0; e < last; {
		e = min(last, e+sbs*(1+rng.IntN(4)))
		ends = append(ends, e)
	}
	return ends
}

// oracleRand returns the random source of one oracle test: seeded from
// KVMESH_ORACLE_SEED when set, else from the clock, and logged so that a
// failure can be replayed; stream tells the tests apart.
func oracleRand(t *testing.T, stream uint64) *rand.Rand {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("KVMESH_ORACLE_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("KVMESH_ORACLE_SEED=%q: %v", v, err)
		}
	}
	t.Logf("seed %d (KVMESH_ORACLE_SEED=%d reproduces it)", seed, seed)
	return rand.New(rand.NewPCG(seed, stream))
}

func TestOracleParity(t *testing.T) {
	rng := oracleRand(t, 14)
	const cases = 4000
	hits, loads := 0, 0
	defer func() { t.Logf("%d cases: %d with a hit, %d loads compared", cases, hits, loads) }()
	for c := range cases {
		w := randomVLLayout(rng)
		m := w.model()
		if err := m.Validate(); err != nil {
			t.Fatalf("case %d: layout %+v refused: %v", c, w, err)
		}
		o := newVLOracle(w.groups, w.hbs)
		sbs := m.SchedulerBlockSize()
		if sbs != o.lcm {
			t.Fatalf("case %d: scheduler block %d, oracle lcm %d", c, sbs, o.lcm)
		}
		maxTokens := sbs * 12
		trunk := maxTokens / w.hbs
		// Earlier requests, their saves compared chunk for chunk.
		for r := range 1 + rng.IntN(4) {
			n := 1 + rng.IntN(maxTokens)
			diverge := rng.IntN(trunk + 1)
			extra := 0
			if rng.IntN(3) == 0 {
				extra = 1 + rng.IntN(3*sbs) // preempted, resumed with more tokens
			}
			hashes := chain(r, diverge, (n+extra)/w.hbs)
			runs := [][]int{stepEnds(rng, n, sbs)}
			if extra > 0 {
				k := rng.IntN(len(runs[0]) + 1)
				runs = [][]int{runs[0][:k], stepEnds(rng, n+extra, sbs)} // the resumed run saves from 0
			}
			for _, ends := range runs {
				start := 0
				for _, e := range ends {
					for g := range m.Groups {
						var want []Chunk
						for _, i := range o.storeMask(g, start, e) {
							want = append(want, Chunk{Start: i * w.groups[g].bs, End: (i + 1) * w.groups[g].bs})
						}
						if got := m.SaveChunks(g, start, e); !reflect.DeepEqual(got, want) {
							t.Fatalf("case %d: %+v group %d save [%d,%d): kvmesh %v, vLLM %v", c, w, g, start, e, got, want)
						}
					}
					o.save(hashes, start, e)
					start = e
				}
			}
		}
		// The request looked up, sharing a prefix with one of them or the trunk.
		n := rng.IntN(maxTokens + sbs)
		owner := 100 + rng.IntN(5)
		hashes := chain(owner, rng.IntN(trunk+1), n/w.hbs)
		if rng.IntN(2) == 0 {
			hashes = chain(rng.IntN(4), trunk, n/w.hbs) // an earlier request's own tail
		}
		bh := make([]BlockHash, len(hashes))
		for i, h := range hashes {
			bh[i] = BlockHash(h)
		}
		kb := KeyBuilder{Model: m.Name}
		p, err := PlanLookup(m, kb, bh, n)
		if err != nil {
			t.Fatalf("case %d: PlanLookup: %v", c, err)
		}
		answers := make([]bool, len(p.Keys()))
		for i, k := range p.Keys() {
			var g int
			var h []byte
			if _, err := fmt.Sscanf(k, "oracle@tp_rank:0@pcp0@dcp0@pp_rank:0@group:%d@%x", &g, &h); err != nil {
				t.Fatalf("case %d: key %q: %v", c, k, err)
			}
			answers[i] = o.stored[[2]string{fmt.Sprint(g), string(h)}]
		}
		hit, err := p.Resolve(answers)
		if err != nil {
			t.Fatalf("case %d: Resolve: %v", c, err)
		}
		want := o.lookup(hashes, n)
		if hit != want {
			t.Fatalf("case %d: %+v, %d tokens: kvmesh hit %d, vLLM %d", c, w, n, hit, want)
		}
		if hit > 0 {
			hits++
		}
		computed := rng.IntN(n/sbs+1) * sbs
		spec := checkDecide(t, c, hit, computed, want)
		if spec == nil {
			continue
		}
		loads++
		start, end := m.LoadRange(*spec)
		for _, gc := range m.LoadGroups(start, end) {
			if wantLoad := o.loadChunks(hashes, gc.Group, computed, want); !reflect.DeepEqual(gc.Chunks, append([]Chunk{}, wantLoad...)) {
				t.Fatalf("case %d: %+v group %d load [%d,%d): kvmesh %v, vLLM %v", c, w, gc.Group, computed, want, gc.Chunks, wantLoad)
			}
		}
	}
}

// vlFine is an independent transcription of vLLM's rules for layouts with
// partial hash hits on (coordinator.py partial_hash_hits_enabled: a Mamba
// block larger than the hash block), sharing no code with kvmesh:
//
//   - save: the positional save of each step (store_mask: full attention
//     and MLA every block, Mamba masked out), the Mamba state at each
//     step's end (worker.py _boundary_snapshot_puts) and the sub-block
//     prompt tail (worker.py _sub_block_tail_puts);
//   - lookup: worker.py MooncakeStoreWorker.lookup with fine_grained (every
//     group asked for every hash block, align_lookup_length to the hash
//     block), _find_hit_blocks with alignment_tokens = hash_block_size and
//     the fine-grained branches of FullAttentionManager and MambaManager
//     find_longest_cache_hit; the tail keys of _tail_key_boundaries;
//   - load: KVCacheStoreRecvingThread._handle_request (process_tokens from
//     floor(vllm_cached, scheduler block), load_mask over an all-present
//     pool, the chunk ending at token_len keyed by its tail boundary).
type vlFine struct {
	groups []vlGroup
	hbs    int
	bs     int // every group's block: full attention and Mamba share the cache block
	stored map[[2]string]bool
}

func (o *vlFine) has(g int, h string) bool { return o.stored[[2]string{strconv.Itoa(g), h}] }
func (o *vlFine) put(g int, h string)      { o.stored[[2]string{strconv.Itoa(g), h}] = true }

// step stores one step's save of [start, tokenLen) (tokenLen a multiple of
// the block): the positional chunks and the Mamba state at its end.
func (o *vlFine) step(hashes []string, start, tokenLen int) [][]Chunk {
	out := make([][]Chunk, len(o.groups))
	for g, grp := range o.groups {
		for i := cdiv(start, o.bs); i < tokenLen/o.bs; i++ {
			if grp.kind == "mamba" && (i+1)*o.bs != tokenLen {
				continue
			}
			out[g] = append(out[g], Chunk{Start: i * o.bs, End: (i + 1) * o.bs})
			o.put(g, hashes[(i+1)*o.bs/o.hbs-1])
		}
	}
	return out
}

// tail stores _sub_block_tail_puts for the boundary of a prompt of n
// tokens, the sender having saved saved tokens.
func (o *vlFine) tail(hashes []string, saved, n int) [][]Chunk {
	out := make([][]Chunk, len(o.groups))
	boundary := n / o.hbs * o.hbs
	if boundary == 0 || boundary%o.bs == 0 {
		return out
	}
	last := cdiv(boundary, o.bs) - 1
	for g, grp := range o.groups {
		for b := min(saved/o.bs, last); b <= last; b++ {
			end := min((b+1)*o.bs, boundary)
			if grp.kind == "mamba" && end != boundary {
				continue
			}
			out[g] = append(out[g], Chunk{Start: b * o.bs, End: end})
			o.put(g, hashes[end/o.hbs-1])
		}
	}
	return out
}

// spec groups, full attention first, identical groups merged.
func (o *vlFine) specs() [][]int {
	var keys []vlGroup
	var specs [][]int
	for i, g := range o.groups {
		j := slices.Index(keys, g)
		if j < 0 {
			keys = append(keys, g)
			specs = append(specs, nil)
			j = len(specs) - 1
		}
		specs[j] = append(specs[j], i)
	}
	isFull := func(s []int) bool { return o.groups[s[0]].kind != "mamba" }
	slices.SortStableFunc(specs, func(a, b []int) int {
		if isFull(a) == isFull(b) {
			return 0
		}
		if isFull(a) {
			return -1
		}
		return 1
	})
	return specs
}

func (o *vlFine) cachedAll(ids []int, h string) bool {
	for _, g := range ids {
		if !o.has(g, h) {
			return false
		}
	}
	return true
}

// find is the fine-grained find_longest_cache_hit of a spec.
func (o *vlFine) find(hashes []string, ids []int, maxLen int) int {
	scale := o.bs / o.hbs
	if o.groups[ids[0]].kind == "mamba" {
		for fine := min(maxLen/o.hbs, len(hashes)) - 1; fine >= 0; fine-- {
			if o.cachedAll(ids, hashes[fine]) {
				return (fine + 1) * o.hbs
			}
		}
		return 0
	}
	blocks := 0
	for i := 0; i < maxLen/o.bs; i++ {
		if !o.cachedAll(ids, hashes[(i+1)*scale-1]) {
			break
		}
		blocks++
	}
	hit := blocks * o.bs
	first := blocks * scale
	for fine := min(first+scale-1, maxLen/o.hbs, len(hashes)) - 1; fine >= first; fine-- {
		if o.cachedAll(ids, hashes[fine]) {
			hit = (fine + 1) * o.hbs
			break
		}
	}
	return hit - hit%o.hbs
}

func (o *vlFine) converge(hashes []string, maxLen int) int {
	specs := o.specs()
	full := map[int]int{}
	simple := len(specs) == 2 && o.groups[specs[0][0]].kind != "mamba"
	hit := maxLen
	for {
		curr := hit
		for k, s := range specs {
			if o.groups[s[0]].kind != "mamba" {
				if _, ok := full[k]; !ok {
					full[k] = o.find(hashes, s, curr)
				}
				curr = min(curr, full[k])
				continue
			}
			curr = o.find(hashes, s, curr)
		}
		if curr >= hit {
			break
		}
		hit = curr
		if simple {
			break
		}
	}
	return hit
}

// lookup is MooncakeStoreWorker.lookup: the hit and each group's tail key.
func (o *vlFine) lookup(hashes []string, numTokens int) (int, []TailKey) {
	tokenLen := numTokens / o.hbs * o.hbs
	if tokenLen <= 0 || len(hashes) == 0 {
		return 0, nil
	}
	hit := o.converge(hashes, tokenLen)
	if hit >= numTokens {
		usable := (numTokens - 1) / o.hbs * o.hbs
		if usable <= 0 {
			return 0, nil
		}
		hit = o.converge(hashes, usable)
	}
	if hit <= 0 {
		return hit, nil
	}
	var tails []TailKey
	idx := hit/o.hbs - 1
	for g := range o.groups {
		boundary := hit
		if !o.has(g, hashes[idx]) {
			next := min(cdiv(hit, o.bs)*o.bs/o.hbs, len(hashes))
			boundary = -1
			for i := idx + 1; i < next; i++ {
				if o.has(g, hashes[i]) {
					boundary = (i + 1) * o.hbs
					break
				}
			}
		}
		tails = append(tails, TailKey{Group: g, Tokens: boundary})
	}
	return hit, tails
}

// load is what the receiving thread reads for group g, each chunk given as
// [start, key boundary): the hash of its end keys it.
func (o *vlFine) load(g, vllmCached, tokenLen int, tails []TailKey) []Chunk {
	maskNum := vllmCached / o.bs * o.bs // the scheduler block is the cache block
	var out []Chunk
	stateBlock := (tokenLen/o.hbs - 1) / (o.bs / o.hbs)
	for i := cdiv(maskNum, o.bs); i < cdiv(tokenLen, o.bs); i++ {
		if o.groups[g].kind == "mamba" && i != stateBlock {
			continue
		}
		end := min((i+1)*o.bs, tokenLen)
		if end == tokenLen {
			for _, tk := range tails {
				if tk.Group == g {
					end = tk.Tokens
				}
			}
		}
		out = append(out, Chunk{Start: i * o.bs, End: end})
	}
	return out
}

func randomFineLayout(rng *rand.Rand) vlWorkload {
	hbs := []int{4, 8, 16}[rng.IntN(3)]
	bs := hbs * (2 + rng.IntN(3))
	var groups []vlGroup
	for range rng.IntN(3) {
		groups = append(groups, vlGroup{kind: []string{"full", "mla"}[rng.IntN(2)], bs: bs})
	}
	for range 1 + rng.IntN(2) {
		groups = append(groups, vlGroup{kind: "mamba", bs: bs})
	}
	rng.Shuffle(len(groups), func(i, j int) { groups[i], groups[j] = groups[j], groups[i] })
	return vlWorkload{groups: groups, hbs: hbs}
}

// TestOracleParityPartial holds layouts with partial hash hits (Mamba block
// 2–4 hash blocks, full attention / MLA of the same block, duplicated specs)
// to vlFine: random prefix-sharing requests saved in chunked steps with
// their sub-block prompt tails (some preempted and re-saved from 0 with more
// tokens), then a lookup whose hit, tail keys, answer and load chunks are
// compared.
func TestOracleParityPartial(t *testing.T) {
	rng := oracleRand(t, 38)
	const cases = 4000
	hits, subBlock, tailed, loads := 0, 0, 0, 0
	defer func() {
		t.Logf("%d cases: %d with a hit (%d inside a block, %d with a later tail key), %d loads compared", cases, hits, subBlock, tailed, loads)
	}()
	for c := range cases {
		w := randomFineLayout(rng)
		m := w.model()
		if err := m.Validate(); err != nil || !m.PartialHashHits() {
			t.Fatalf("case %d: layout %+v: Validate %v, partial hits %v", c, w, err, m.PartialHashHits())
		}
		o := &vlFine{groups: w.groups, hbs: w.hbs, bs: w.groups[0].bs, stored: map[[2]string]bool{}}
		sbs := m.SchedulerBlockSize()
		maxTokens := sbs * 8
		trunk := maxTokens / w.hbs
		check := func(what string, g int, got, want []Chunk) {
			if len(got) == 0 && len(want) == 0 {
				return
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("case %d: %+v group %d %s: kvmesh %v, vLLM %v", c, w, g, what, got, want)
			}
		}
		for r := range 1 + rng.IntN(5) {
			n := 1 + rng.IntN(maxTokens)
			extra := 0
			if rng.IntN(3) == 0 {
				extra = 1 + rng.IntN(2*sbs)
			}
			hashes := chain(r, rng.IntN(trunk+1), (n+extra)/w.hbs)
			type run struct {
				ends   []int
				prompt int
			}
			runs := []run{{stepEnds(rng, n, sbs), n}}
			if extra > 0 {
				k := rng.IntN(len(runs[0].ends) + 1)
				runs = []run{{runs[0].ends[:k], 0}, {stepEnds(rng, n+extra, sbs), n + extra}}
			}
			for _, ru := range runs {
				start, before := 0, 0
				for _, e := range ru.ends {
					want := o.step(hashes, start, e)
					for g := range m.Groups {
						check(fmt.Sprintf("save [%d,%d)", start, e), g, m.SaveChunks(g, start, e), want[g])
					}
					before, start = start, e
				}
				if ru.prompt == 0 {
					continue // preempted before its prompt's last boundary
				}
				saved := before // the tail rides the last step's job
				if rng.IntN(2) == 0 {
					saved = start // or a step of its own past the last block
				}
				want := o.tail(hashes, saved, ru.prompt)
				for g := range m.Groups {
					check(fmt.Sprintf("prompt tail (saved %d, %d tokens)", saved, ru.prompt), g, m.PromptTailChunks(g, saved, ru.prompt), want[g])
				}
			}
		}
		if rng.IntN(2) == 0 {
			// Store pressure evicted some keys: hits fall back to shorter
			// boundaries and tails to later keys of the same block.
			for k := range o.stored {
				if rng.IntN(5) == 0 {
					delete(o.stored, k)
				}
			}
		}
		n := rng.IntN(maxTokens + sbs)
		hashes := chain(100+rng.IntN(5), rng.IntN(trunk+1), n/w.hbs)
		if rng.IntN(2) == 0 {
			hashes = chain(rng.IntN(5), trunk, n/w.hbs)
		}
		bh := make([]BlockHash, len(hashes))
		for i, h := range hashes {
			bh[i] = BlockHash(h)
		}
		p, err := PlanLookup(m, KeyBuilder{Model: m.Name}, bh, n)
		if err != nil {
			t.Fatalf("case %d: PlanLookup: %v", c, err)
		}
		if want := len(m.Groups) * (n / w.hbs); len(p.Keys()) != want {
			t.Fatalf("case %d: %d keys for %d tokens, want every group at every hash block: %d", c, len(p.Keys()), n, want)
		}
		answers := make([]bool, len(p.Keys()))
		for i, k := range p.Keys() {
			var g int
			var h []byte
			if _, err := fmt.Sscanf(k, "oracle@tp_rank:0@pcp0@dcp0@pp_rank:0@group:%d@%x", &g, &h); err != nil {
				t.Fatalf("case %d: key %q: %v", c, k, err)
			}
			answers[i] = o.has(g, string(h))
		}
		hit, err := p.Resolve(answers)
		if err != nil {
			t.Fatalf("case %d: Resolve: %v", c, err)
		}
		want, wantTails := o.lookup(hashes, n)
		if hit != want {
			t.Fatalf("case %d: %+v, %d tokens: kvmesh hit %d, vLLM %d", c, w, n, hit, want)
		}
		tails, err := p.TailKeys(answers, hit)
		if err != nil || !reflect.DeepEqual(tails, wantTails) {
			t.Fatalf("case %d: %+v, hit %d: tail keys %v (%v), vLLM %v", c, w, hit, tails, err, wantTails)
		}
		if hit > 0 {
			hits++
			if hit%sbs != 0 {
				subBlock++
			}
			if slices.ContainsFunc(tails, func(tk TailKey) bool { return tk.Tokens != hit }) {
				tailed++
			}
		}
		computed := rng.IntN(n + 1)
		spec := checkDecide(t, c, hit, computed, want)
		if spec == nil {
			continue
		}
		loads++
		start, end := m.LoadRange(*spec)
		for _, gc := range m.LoadGroupsTail(start, end, tails) {
			check(fmt.Sprintf("load [%d,%d)", computed, want), gc.Group, gc.Chunks, o.load(gc.Group, computed, want, wantTails))
		}
	}
}
