package kvpublish

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// kafkaBackoff spaces the retries of a failed partition lookup or fetch.
var kafkaBackoff = retry.Backoff{Initial: 100 * time.Millisecond, Max: 5 * time.Second, Jitter: 0.2}

// errNoPartitions reports a topic that has no partitions (yet).
var errNoPartitions = errors.New("kvpublish: topic has no partitions")

// partitions finds the topic's partitions, retrying until the brokers
// answer with at least one or ctx ends. Partitions added later are not
// read until the service restarts.
func (p *Publisher) partitions(ctx context.Context) ([]int, error) {
	dialer := p.opts.Dialer
	if dialer == nil {
		dialer = kafka.DefaultDialer
	}
	return retry.Do(ctx, kafkaBackoff, func() ([]int, error) {
		var errs []error
		for _, b := range p.opts.Brokers {
			parts, err := dialer.LookupPartitions(ctx, "tcp", b, p.opts.Topic)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if len(parts) == 0 {
				errs = append(errs, fmt.Errorf("%s: %w", p.opts.Topic, errNoPartitions))
				continue
			}
			ids := make([]int, len(parts))
			for i, pt := range parts {
				ids[i] = pt.ID
			}
			return ids, nil
		}
		return nil, errors.Join(errs...)
	}, func(err error, d time.Duration) {
		p.opts.Logger.Warn("kv events zmq publisher: looking up the topic's partitions failed; retrying", "topic", p.opts.Topic, "err", err, "delay", d)
	})
}

// read hands every record of one partition, from its earliest retained
// offset, to out until ctx ends. Fetch errors are logged and retried.
func (p *Publisher) read(ctx context.Context, partition int, out chan<- kafka.Message) {
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: p.opts.Brokers, Dialer: p.opts.Dialer, Topic: p.opts.Topic, Partition: partition,
		MaxWait: p.opts.MaxWait, StartOffset: kafka.FirstOffset,
		ErrorLogger: kafka.LoggerFunc(func(format string, args ...any) {
			p.opts.Logger.Debug("kv events zmq publisher: kafka reader: " + fmt.Sprintf(format, args...))
		}),
	})
	defer func() { _ = r.Close() }()
	failures := 0
	for {
		m, err := r.FetchMessage(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			failures++
			d := kafkaBackoff.Delay(failures)
			p.opts.Logger.Warn("kv events zmq publisher: fetch failed; retrying", "topic", p.opts.Topic, "partition", partition, "err", err, "delay", d)
			if retry.Sleep(ctx, d) != nil {
				return
			}
			continue
		}
		failures = 0
		select {
		case out <- m:
		case <-ctx.Done():
			return
		}
	}
}

// publishLoop publishes the records it is handed, one at a time, until
// ctx ends: it owns the sequence counter and, with ClearAsRemoved, the set
// of live hashes an AllBlocksCleared is followed by the removal of.
func (p *Publisher) publishLoop(ctx context.Context, in <-chan kafka.Message) {
	var seq uint64
	held := live{}
	publish := func(payload []byte) {
		p.send(seq, payload)
		seq++
		p.opts.Metrics.seq.Set(float64(seq))
	}
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-in:
			rec, payload, ok := p.keep(m)
			if !ok {
				continue
			}
			publish(payload)
			if !p.opts.ClearAsRemoved {
				continue
			}
			held.track(rec)
			if rec.Kind() == contract.AllBlocksCleared {
				p.clearHeld(held, rec.Batch.TS, publish)
			}
		}
	}
}

// clearHeld publishes the BlockRemoved batches of every held hash
// (live.clearBatches) and empties the set.
func (p *Publisher) clearHeld(held live, ts float64, publish func([]byte)) {
	for _, b := range held.clearBatches(ts) {
		payload, err := contract.EncodeKVEventBatch(b, p.opts.Form)
		if err != nil { // kvmesh's own batch: a bug, not a record's fault
			p.opts.Logger.Error("kv events zmq publisher: encoding the removals of a clear failed", "err", err)
			return
		}
		publish(payload)
		p.opts.Metrics.clearedBlocks.Add(float64(len(b.Events[0].BlockHashes)))
	}
}

// keep decodes m and returns it with its batch re-encoded in the
// publisher's form, or false for a record it skips (counted by reason) or
// cannot decode (counted and logged).
func (p *Publisher) keep(m kafka.Message) (contract.KVEventRecord, []byte, bool) {
	headers := make(map[string]string, len(m.Headers))
	for _, h := range m.Headers {
		headers[h.Key] = string(h.Value)
	}
	rec, err := contract.DecodeKVEventRecord(m.Value, headers)
	if err != nil {
		p.decodeFailed(m, err)
		return rec, nil, false
	}
	if reason := p.skipReason(rec); reason != "" {
		p.opts.Metrics.skipped.WithLabelValues(reason).Inc()
		return rec, nil, false
	}
	if rec.Batch.DataParallelRank == nil {
		rec.Batch.DataParallelRank = new(int)
	}
	payload, err := contract.EncodeKVEventBatch(rec.Batch, p.opts.Form)
	if err != nil {
		p.decodeFailed(m, err)
		return rec, nil, false
	}
	return rec, payload, true
}

func (p *Publisher) decodeFailed(m kafka.Message, err error) {
	p.opts.Metrics.decodeFailures.Inc()
	p.opts.Logger.Warn("kv events zmq publisher: record not decodable; skipped",
		"topic", m.Topic, "partition", m.Partition, "offset", m.Offset, "err", err)
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
