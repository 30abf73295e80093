package ledger

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"sync"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// A request's trackers keep two parts that grow with the prompt: the hash
// chain and the block tables. They are append-only between generations, so
// the ledger writes them once, in segments (tables tracker_hashes and
// tracker_blocks), and keeps them out of the tracker JSON that every event
// rewrites. An event costs the small mutable state plus the segments it
// adds, whatever the prompt's length. The prompt's token ids, when the
// engine sent them, are kept the same way in one row of tracker_tokens
// (4 bytes a token), written when the request is admitted and again only
// if a longer list arrives.

// Tracker slots in tracker_blocks and PartsMeta.Slots.
const (
	slotStore = 0
	slotPD    = 1
	numSlots  = 2
)

// PartsMeta is what the segments of one request hold (the trackers.parts
// column): the chain length, and per tracker slot the table generation and
// each group's length. A reader's cached parts are valid while they match.
type PartsMeta struct {
	// Hashes is the length of the hash chain.
	Hashes int `json:"hashes"`
	// PDHashes is the length of the pd tracker's chain, a prefix of the
	// request's chain (-1: the pd tracker keeps its own chain inline).
	PDHashes int `json:"pd_hashes,omitempty"`
	// Tokens is the number of token ids tracker_tokens holds.
	Tokens int `json:"tokens,omitempty"`
	// Slots are the block tables of the store tracker and the pd tracker.
	Slots [numSlots]SlotMeta `json:"slots"`
}

// SlotMeta describes one tracker's block table.
type SlotMeta struct {
	// Gen is the table generation; a replaced table starts a new one.
	Gen int `json:"gen"`
	// Lens are the groups' lengths; nil is no table.
	Lens []int `json:"lens"`
}

// equal reports whether m and o describe the same segments.
func (m *PartsMeta) equal(o *PartsMeta) bool {
	if m.Hashes != o.Hashes || m.PDHashes != o.PDHashes || m.Tokens != o.Tokens {
		return false
	}
	for s := range m.Slots {
		a, b := m.Slots[s], o.Slots[s]
		if a.Gen != b.Gen || (a.Lens == nil) != (b.Lens == nil) || !slices.Equal(a.Lens, b.Lens) {
			return false
		}
	}
	return true
}

// empty reports whether m describes no segment at all.
func (m *PartsMeta) empty() bool {
	return m.Hashes == 0 && m.PDHashes == 0 && m.Tokens == 0 && m.Slots[slotStore].Lens == nil && m.Slots[slotPD].Lens == nil &&
		m.Slots[slotStore].Gen == 0 && m.Slots[slotPD].Gen == 0
}

// parts is one request's chain and tables as stored: meta says what the
// segments hold; hashes and tables are their contents.
type parts struct {
	meta   PartsMeta
	hashes []string
	tokens []uint32
	tables [numSlots]kvcore.BlockTable
}

// hashSegment and blockSegment are rows to insert.
type hashSegment struct {
	start  int
	hashes []string
}

type blockSegment struct {
	slot, gen, grp, start int
	blocks                []int64
}

// delta is what storing a request writes beyond its small state.
type delta struct {
	hashes []hashSegment
	// rewriteHashes deletes the stored chain before hashes are inserted.
	rewriteHashes bool
	blocks        []blockSegment
	// tokens is set when the token ids changed: the row is written whole.
	tokens []uint32
	// writeTokens says tokens is to be written.
	writeTokens bool
	// newGen lists the slots whose table was replaced: their rows of older
	// generations are deleted.
	newGen []int
}

// slotTrackers returns the request's trackers by slot (nil: none).
func slotTrackers(req *requeststate.Request) [numSlots]*requeststate.Tracker {
	return [numSlots]*requeststate.Tracker{slotStore: req.Store, slotPD: req.PD}
}

// install puts p's chain and tables into req's trackers (clipped, so an
// append by the tracker never writes into p's arrays).
func (p *parts) install(req *requeststate.Request) {
	req.Store.Hashes = slices.Clip(p.hashes)
	req.Store.TokenIDs = slices.Clip(p.tokens)
	if req.PD != nil && p.meta.PDHashes >= 0 && p.meta.PDHashes <= len(p.hashes) {
		req.PD.Hashes = slices.Clip(p.hashes[:p.meta.PDHashes])
	}
	for s, t := range slotTrackers(req) {
		if t != nil {
			t.Table = clipTable(p.tables[s])
		}
	}
}

// clipTable returns t with every group clipped to its length.
func clipTable(t kvcore.BlockTable) kvcore.BlockTable {
	if t == nil {
		return nil
	}
	out := make(kvcore.BlockTable, len(t))
	for g := range t {
		out[g] = slices.Clip(t[g])
	}
	return out
}

// diff compares req's trackers with the stored parts old and returns the
// new parts and the segments to write. The chain only grows; a table
// either grows in every group (appended segments) or is replaced (a new
// generation holding the whole table).
func diff(old *parts, req *requeststate.Request) (*parts, delta) {
	var d delta
	nw := &parts{meta: old.meta}
	h := req.Store.Hashes
	switch {
	case len(h) > len(old.hashes) && slices.Equal(h[:len(old.hashes)], old.hashes):
		d.hashes = append(d.hashes, hashSegment{start: len(old.hashes), hashes: h[len(old.hashes):]})
	case !slices.Equal(h, old.hashes):
		// kvcore never does this (the chain only grows); should it happen,
		// the whole chain is written again.
		d.rewriteHashes = true
		if len(h) > 0 {
			d.hashes = append(d.hashes, hashSegment{start: 0, hashes: h})
		}
	}
	nw.hashes = h
	nw.meta.Hashes = len(h)
	if tok := req.Store.TokenIDs; !slices.Equal(tok, old.tokens) {
		d.tokens, d.writeTokens = tok, true
	}
	nw.tokens = req.Store.TokenIDs
	nw.meta.Tokens = len(req.Store.TokenIDs)
	nw.meta.PDHashes = 0
	if req.PD != nil {
		nw.meta.PDHashes = -1
		if p := req.PD.Hashes; len(p) <= len(h) && slices.Equal(p, h[:len(p)]) {
			nw.meta.PDHashes = len(p)
		}
	}
	for s, t := range slotTrackers(req) {
		var table kvcore.BlockTable
		if t != nil {
			table = t.Table
		}
		nw.tables[s] = table
		d.table(&nw.meta.Slots[s], s, old.tables[s], table)
	}
	return nw, d
}

// table records the segments of one slot's table and updates its meta.
func (d *delta) table(meta *SlotMeta, slot int, old, nw kvcore.BlockTable) {
	if nw == nil {
		if old != nil {
			meta.Gen++
			d.newGen = append(d.newGen, slot)
		}
		meta.Lens = nil
		return
	}
	if old != nil && appended(old, nw) {
		for g := range nw {
			if len(nw[g]) > len(old[g]) {
				d.blocks = append(d.blocks, blockSegment{slot: slot, gen: meta.Gen, grp: g, start: len(old[g]), blocks: ids(nw[g][len(old[g]):])})
			}
		}
		meta.Lens = lens(nw)
		return
	}
	if old != nil || meta.Lens != nil || meta.Gen > 0 {
		meta.Gen++
		d.newGen = append(d.newGen, slot)
	}
	for g := range nw {
		if len(nw[g]) > 0 {
			d.blocks = append(d.blocks, blockSegment{slot: slot, gen: meta.Gen, grp: g, start: 0, blocks: ids(nw[g])})
		}
	}
	meta.Lens = lens(nw)
}

// appended reports whether nw is old with block ids appended per group.
func appended(old, nw kvcore.BlockTable) bool {
	if len(old) != len(nw) {
		return false
	}
	for g := range old {
		if len(nw[g]) < len(old[g]) || !slices.Equal(nw[g][:len(old[g])], old[g]) {
			return false
		}
	}
	return true
}

func lens(t kvcore.BlockTable) []int {
	out := make([]int, len(t))
	for g := range t {
		out[g] = len(t[g])
	}
	return out
}

func ids(b []kvcore.BlockID) []int64 {
	out := make([]int64, len(b))
	for i, v := range b {
		out[i] = int64(v)
	}
	return out
}

// smallJSON encodes the request's mutable state: its trackers without the
// parts (the pd tracker keeps its chain inline only when it is not a
// prefix of the request's, meta.PDHashes -1).
func smallJSON(req *requeststate.Request, meta *PartsMeta) (tracker, extras []byte, err error) {
	st := *req.Store
	st.Hashes, st.Table, st.TokenIDs = nil, nil, nil
	if tracker, err = requeststate.MarshalTracker(&st); err != nil {
		return nil, nil, fmt.Errorf("ledger: %w", err)
	}
	x := req.Extras
	if req.PD != nil {
		pd := *req.PD
		pd.Table = nil
		if meta.PDHashes >= 0 {
			pd.Hashes = nil
		}
		x.PD = &pd
	}
	if extras, err = requeststate.MarshalExtras(x); err != nil {
		return nil, nil, fmt.Errorf("ledger: encode extras of %s/%s: %w", req.Store.EngineID, req.Store.RequestID, err)
	}
	return tracker, extras, nil
}

// partsCache keeps the parts of recently applied requests, so an event
// reads only the small row. An entry is used only while its meta equals
// the row's (and the row is the same incarnation), so any writer — another
// consumer, another replica — invalidates it by changing the row.
//
// An entry also keeps the request itself, decoded, with the row version
// (xmin) it was stored at: while the row is still at that version, the
// lock reads neither its tracker nor its extras, and nothing is decoded.
// Any write of the row, by anyone, changes its xmin. A transaction takes
// the request out of the cache (take) and puts its new state back after
// its commit, so no two transactions hold one request object and a
// rolled-back change is never seen.
type partsCache struct {
	mu      sync.Mutex
	max     int
	entries map[Key]*cachedParts
	order   []Key // insertion order, for eviction
}

type cachedParts struct {
	born  int64 // the row's created_at, in µs: one incarnation of the key
	parts *parts
	// xmin is the row version req was stored at; req is nil once taken.
	xmin int64
	req  *requeststate.Request
}

// DefaultPartsCacheEntries bounds the parts cache (requests).
const DefaultPartsCacheEntries = 65536

func newPartsCache(n int) *partsCache {
	return &partsCache{max: n, entries: map[Key]*cachedParts{}}
}

// get returns the cached parts of k when they match meta and born.
func (c *partsCache) get(k Key, born int64, meta *PartsMeta) *parts {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[k]
	if e == nil || e.born != born || !e.parts.meta.equal(meta) {
		return nil
	}
	return e.parts
}

// take returns k's entry with its decoded request, which it leaves the
// cache without (nil: none cached).
func (c *partsCache) take(k Key) *cachedParts {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entries[k]
	if e == nil || e.req == nil {
		return nil
	}
	out := *e
	e.req = nil
	return &out
}

// put records k's parts, and its request as stored at row version xmin,
// after a commit.
func (c *partsCache) put(k Key, born int64, p *parts, xmin int64, req *requeststate.Request) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.entries[k]; !ok {
		c.order = append(c.order, k)
	}
	c.entries[k] = &cachedParts{born: born, parts: p, xmin: xmin, req: req}
	for len(c.entries) > c.max && len(c.order) > 0 {
		delete(c.entries, c.order[0])
		c.order = c.order[1:]
	}
	if len(c.order) > 2*c.max {
		c.order = slices.DeleteFunc(c.order, func(k Key) bool { _, ok := c.entries[k]; return !ok })
	}
}

// packTokens encodes token ids as tracker_tokens stores them: 4 bytes
// each, little-endian.
func packTokens(tokens []uint32) []byte {
	out := make([]byte, 0, 4*len(tokens))
	for _, t := range tokens {
		out = binary.LittleEndian.AppendUint32(out, t)
	}
	return out
}

// unpackTokens decodes packTokens' encoding.
func unpackTokens(b []byte) ([]uint32, error) {
	if len(b)%4 != 0 {
		return nil, fmt.Errorf("%d bytes of token ids are not 4-byte words: %w", len(b), ErrPartsCorrupt)
	}
	out := make([]uint32, len(b)/4)
	for i := range out {
		out[i] = binary.LittleEndian.Uint32(b[4*i:])
	}
	return out, nil
}

func jsonMarshal(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("ledger: encode: %w", err)
	}
	return b, nil
}

func jsonUnmarshal(b []byte, v any) error {
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	return nil
}
