package kvpublish

import (
	"maps"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// clearChunk is the most block hashes one BlockRemoved of a clear carries.
const clearChunk = 1024

// live is the set of wire hashes the publisher announced stored and not
// removed since: the parents a held BlockStored waits for, and (with
// ClearAsRemoved) what a router that ignores AllBlocksCleared still indexes
// for the store after a flush.
type live map[uint64]struct{}

// has reports whether h was announced stored and not removed since.
func (l live) has(h uint64) bool {
	_, ok := l[h]
	return ok
}

// trackEvent updates the set after e was published: a BlockStored adds its
// hashes, a BlockRemoved takes them out.
func (l live) trackEvent(e contract.KVEvent) {
	switch e.Kind {
	case contract.BlockStored:
		for _, h := range e.BlockHashes {
			l[h] = struct{}{}
		}
	case contract.BlockRemoved:
		for _, h := range e.BlockHashes {
			delete(l, h)
		}
	}
}

// clearBatches empties the set and returns the BlockRemoved batches of
// everything it held, at most clearChunk hashes an event, in hash order,
// stamped ts: what follows an AllBlocksCleared so that a router that
// ignores AllBlocksCleared (llm-d-kv-cache v0.8.1 only logs it) drops the
// store's blocks too.
func (l live) clearBatches(ts float64) []contract.KVEventBatch {
	hashes := slices.Sorted(maps.Keys(l))
	clear(l)
	var out []contract.KVEventBatch
	medium, locality := contract.MediumStore, contract.LocalityStore
	for chunk := range slices.Chunk(hashes, clearChunk) {
		out = append(out, contract.KVEventBatch{TS: ts, DataParallelRank: new(int), Events: []contract.KVEvent{{
			Kind: contract.BlockRemoved, BlockHashes: chunk, Medium: &medium, Locality: &locality,
		}}})
	}
	return out
}
