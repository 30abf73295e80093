package kvpublish

import (
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// DefaultHoldFor is how long a BlockStored event whose parent block the
// publisher has not announced waits for it before it is published anyway.
const DefaultHoldFor = 10 * time.Second

// Outcomes of a held BlockStored event, the outcome label of
// kvmesh_lookup_kv_events_zmq_held_total.
const (
	// HeldReleased: its parent was announced; it followed it.
	HeldReleased = "released"
	// HeldExpired: its parent was not announced within HoldFor; it was
	// published anyway (a router that drops orphans drops it).
	HeldExpired = "expired"
	// HeldDropped: a block of it was removed (or the store cleared) while
	// it waited; it is not published, so no router counts a removed block.
	HeldDropped = "dropped"
)

var heldOutcomes = []string{HeldReleased, HeldExpired, HeldDropped}

// waiting is a BlockStored event held until its parent is announced.
type waiting struct {
	ev    contract.KVEvent
	ts    float64   // its batch's timestamp
	since time.Time // when it was held
}

// order splits a record's events into those that can go now and those
// held: a BlockStored event goes once its parent block is announced (a
// router such as llm-d drops a block whose parent it has not indexed, and
// the sender's records reach Kafka in commit order, so a save that hangs
// its blocks from a prefix it loaded can be published before the save that
// stored that prefix). Every event it lets go is tracked in live, so the
// runs of one batch that chain from each other go together.
func (p *Publisher) order(b contract.KVEventBatch, now time.Time) []contract.KVEvent {
	var ready []contract.KVEvent
	for _, e := range b.Events {
		switch {
		case p.opts.HoldFor > 0 && e.Kind == contract.BlockStored && e.ParentBlockHash != nil && !p.live.has(*e.ParentBlockHash):
			p.waiting = append(p.waiting, waiting{ev: e, ts: b.TS, since: now})
			continue
		case e.Kind == contract.BlockRemoved:
			p.dropWaiting(e.BlockHashes)
		case e.Kind == contract.AllBlocksCleared:
			p.dropWaiting(nil)
		}
		p.live.trackEvent(e)
		ready = append(ready, e)
	}
	return ready
}

// releasable takes from the held events those whose parent is announced
// now (again and again, as each one released announces more) and, when
// expire is set, those held longer than HoldFor; it tracks them in live
// and returns them, each with its batch's timestamp, in the order held.
func (p *Publisher) releasable(now time.Time, expire bool) []waiting {
	var out []waiting
	for progress := true; progress; {
		progress = false
		for i := 0; i < len(p.waiting); i++ {
			w := p.waiting[i]
			parentKnown := p.live.has(*w.ev.ParentBlockHash)
			if !parentKnown && !(expire && now.Sub(w.since) >= p.opts.HoldFor) {
				continue
			}
			outcome := HeldReleased
			if !parentKnown {
				outcome = HeldExpired
			}
			p.opts.Metrics.held.WithLabelValues(outcome).Inc()
			p.live.trackEvent(w.ev)
			out = append(out, w)
			p.waiting = slices.Delete(p.waiting, i, i+1)
			i--
			progress = true
		}
	}
	return out
}

// dropWaiting drops the held events that store one of hashes (every held
// event for nil, a clear).
func (p *Publisher) dropWaiting(hashes []uint64) {
	p.waiting = slices.DeleteFunc(p.waiting, func(w waiting) bool {
		if hashes != nil && !slices.ContainsFunc(w.ev.BlockHashes, func(h uint64) bool { return slices.Contains(hashes, h) }) {
			return false
		}
		p.opts.Metrics.held.WithLabelValues(HeldDropped).Inc()
		return true
	})
}
