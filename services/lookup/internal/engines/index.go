// Package engines is the lookup's view of the engines' own prefix caches:
// from the vLLM KV events engines publish to kvmesh.kv.events (their own
// batches, without kvmesh's schema header, naming the engine in the
// kvmesh-engine-id header), an in-memory set of wire hashes per engine and
// KV-cache group, which POST /v1/score scores prompts against.
package engines

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// MediumGPU is vLLM's medium of an engine's GPU prefix cache
// (vllm/distributed/kv_events.py MEDIUM_GPU); events without a medium are
// the GPU cache's too.
const MediumGPU = "GPU"

// Errors of the index.
var (
	// ErrGroup is an event naming a KV-cache group the model does not have.
	ErrGroup = errors.New("engines: kv event of an unknown group")
)

// Index holds, per engine and KV-cache group, the wire hashes
// (contract.WireHash) of the blocks the engine's GPU prefix cache holds:
// BlockStored adds, BlockRemoved removes (from every group when it names
// none), AllBlocksCleared empties the engine's sets. Events of other media
// (an engine's CPU or storage tiers) are ignored: a block leaving the GPU
// cache is then never mistaken for one still held. It is safe for
// concurrent use.
type Index struct {
	groups  int
	mu      sync.RWMutex
	engines map[string][]map[uint64]struct{}
}

// NewIndex returns an empty index for a model of groups KV-cache groups.
func NewIndex(groups int) *Index {
	return &Index{groups: groups, engines: map[string][]map[uint64]struct{}{}}
}

// Apply applies one engine's event batch, in order. An event naming a
// group the model does not have is skipped, and reported as an ErrGroup
// error once the rest of the batch is applied.
func (x *Index) Apply(engine string, b contract.KVEventBatch) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	sets := x.sets(engine)
	var errs []error
	for i, e := range b.Events {
		if e.Kind == contract.AllBlocksCleared {
			for g := range sets {
				clear(sets[g])
			}
			continue
		}
		if e.Medium != nil && *e.Medium != MediumGPU {
			continue
		}
		if err := x.apply(sets, e); err != nil {
			errs = append(errs, fmt.Errorf("engine %s event %d: %w", engine, i, err))
		}
	}
	return errors.Join(errs...)
}

// sets returns the engine's sets, made empty on first use.
func (x *Index) sets(engine string) []map[uint64]struct{} {
	sets, ok := x.engines[engine]
	if !ok {
		sets = make([]map[uint64]struct{}, x.groups)
		for g := range sets {
			sets[g] = map[uint64]struct{}{}
		}
		x.engines[engine] = sets
	}
	return sets
}

// apply applies one BlockStored or BlockRemoved event.
func (x *Index) apply(sets []map[uint64]struct{}, e contract.KVEvent) error {
	if e.GroupIdx != nil && (*e.GroupIdx < 0 || *e.GroupIdx >= x.groups) {
		return fmt.Errorf("group %d of %d: %w", *e.GroupIdx, x.groups, ErrGroup)
	}
	targets := sets
	if e.GroupIdx != nil {
		targets = sets[*e.GroupIdx : *e.GroupIdx+1]
	} else if e.Kind == contract.BlockStored {
		targets = sets[:1] // vLLM's group_idx defaults to 0
	}
	for _, set := range targets {
		for _, h := range e.BlockHashes {
			if e.Kind == contract.BlockStored {
				set[h] = struct{}{}
			} else {
				delete(set, h)
			}
		}
	}
	return nil
}

// Presence answers whether an engine's group holds a block, by wire hash.
type Presence func(group int, wire uint64) bool

// Each calls fn for every engine the index has seen, in engine-id order,
// with its presence; the index is read-locked meanwhile (fn must not call
// Apply).
func (x *Index) Each(fn func(engine string, has Presence)) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	ids := make([]string, 0, len(x.engines))
	for id := range x.engines {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		sets := x.engines[id]
		fn(id, func(g int, wire uint64) bool {
			_, ok := sets[g][wire]
			return ok
		})
	}
}
