package kvpublish

import (
	"context"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Handle is the bus handler of kvmesh.kv.events that publishes: it
// decodes the record, keeps it or skips it (counted by reason), re-encodes
// its batch in the publisher's form and sends it with the next seq; with
// ClearAsRemoved it follows an AllBlocksCleared with the removal of every
// block it announced. Records must come one at a time, in topic order (a
// consumer of Concurrency 1): Handle owns the sequence counter. A record
// that does not decode is counted and returned as a permanent failure
// (kvcore.ReasonUndecodable), for the consumer to log and skip.
func (p *Publisher) Handle(_ context.Context, m bus.Received) error {
	rec, err := contract.DecodeKVEventRecord(m.Value, m.Headers)
	if err != nil {
		p.opts.Metrics.decodeFailures.Inc()
		return bus.Permanent(kvcore.ReasonUndecodable, fmt.Errorf("kv events zmq publisher: %w", err))
	}
	if reason := p.skipReason(rec); reason != "" {
		p.opts.Metrics.skipped.WithLabelValues(reason).Inc()
		return nil
	}
	if rec.Batch.DataParallelRank == nil {
		rec.Batch.DataParallelRank = new(int)
	}
	payload, err := contract.EncodeKVEventBatch(rec.Batch, p.opts.Form)
	if err != nil {
		p.opts.Metrics.decodeFailures.Inc()
		return bus.Permanent(kvcore.ReasonUndecodable, fmt.Errorf("kv events zmq publisher: %w", err))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	ready := p.order(rec.Batch, now)
	switch {
	case len(ready) == len(rec.Batch.Events):
		p.publish(payload)
	case len(ready) > 0:
		b := rec.Batch
		b.Events = ready
		p.publishBatch(b)
	}
	if rec.Kind() == contract.AllBlocksCleared {
		if p.opts.ClearAsRemoved {
			p.clearHeld(rec.Batch.TS)
		} else {
			clear(p.live)
		}
	}
	p.publishReleased(p.releasable(now, true))
	return nil
}

// publishReleased publishes each released event in a batch of its own,
// stamped with its record's time.
func (p *Publisher) publishReleased(ws []waiting) {
	for _, w := range ws {
		p.publishBatch(contract.KVEventBatch{TS: w.ts, DataParallelRank: new(int), Events: []contract.KVEvent{w.ev}})
	}
}

// publishBatch encodes b in the publisher's form and publishes it; its
// events come from a record that encoded whole, so a failure is a bug,
// logged.
func (p *Publisher) publishBatch(b contract.KVEventBatch) {
	payload, err := contract.EncodeKVEventBatch(b, p.opts.Form)
	if err != nil {
		p.opts.Logger.Error("kv events zmq publisher: encoding a batch failed", "err", err)
		return
	}
	p.publish(payload)
}

// expireHeld publishes the held events past HoldFor (and what they bring
// along), every tick of hold/4 until ctx ends: a parent that never comes
// must not keep its children back for good.
func (p *Publisher) expireHeld(ctx context.Context) {
	if p.opts.HoldFor < 0 {
		return
	}
	tick := time.NewTicker(max(p.opts.HoldFor/4, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			p.mu.Lock()
			p.publishReleased(p.releasable(now, true))
			p.mu.Unlock()
		}
	}
}

// publish sends payload with the next seq.
func (p *Publisher) publish(payload []byte) {
	p.send(p.seq, payload)
	p.seq++
	p.opts.Metrics.seq.Set(float64(p.seq))
}

// clearHeld publishes the BlockRemoved batches of every live hash
// (live.clearBatches) and empties the set.
func (p *Publisher) clearHeld(ts float64) {
	for _, b := range p.live.clearBatches(ts) {
		payload, err := contract.EncodeKVEventBatch(b, p.opts.Form)
		if err != nil { // kvmesh's own batch: a bug, not a record's fault
			p.opts.Logger.Error("kv events zmq publisher: encoding the removals of a clear failed", "err", err)
			return
		}
		p.publish(payload)
		p.opts.Metrics.clearedBlocks.Add(float64(len(b.Events[0].BlockHashes)))
	}
}

// skipReason is why rec is not published, or "" to publish it: it must
// be kvmesh's, of the deployment's model and key prefix, and of the
// publisher's tenant key space. AllBlocksCleared, which names the whole
// deployment and carries no blocks, goes to every tenant's publisher.
func (p *Publisher) skipReason(rec contract.KVEventRecord) string {
	kb := p.opts.Keys
	switch {
	case rec.Model == "":
		return SkipForeign
	case rec.Model != kb.Model:
		return SkipModel
	case len(rec.Hashes) == 0:
		if rec.Kind() == contract.AllBlocksCleared && rec.Namespace == scope(kb) {
			return ""
		}
		return SkipDeployment
	}
	for _, key := range rec.Keys() {
		parts, ok, err := kb.ParseOwn(key)
		switch {
		case err != nil || !ok:
			return SkipDeployment
		case parts.Tenant != p.opts.Tenant:
			return SkipTenant
		}
	}
	return ""
}

// scope is the namespace of a deployment's AllBlocksCleared:
// "[prefix@]model".
func scope(kb kvcore.KeyBuilder) string {
	if kb.Prefix == "" {
		return kb.Model
	}
	return kb.Prefix + "@" + kb.Model
}

// send publishes one batch as vLLM does, [topic, seq, payload], and keeps
// it for replay.
func (p *Publisher) send(seq uint64, payload []byte) {
	seqBytes := binary.BigEndian.AppendUint64(nil, seq)
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seqBytes, payload)); err != nil {
		p.opts.Logger.Warn("kv events zmq publisher: send failed", "seq", seq, "err", err)
		return
	}
	p.buf.add(seq, payload)
	p.opts.Metrics.published.Inc()
}
