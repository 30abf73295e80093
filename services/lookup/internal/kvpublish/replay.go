package kvpublish

import (
	"context"
	"encoding/binary"
	"sync"

	"github.com/go-zeromq/zmq4"
)

// endSeq is vLLM's end-of-replay marker: -1 as a signed 8-byte big-endian
// integer.
var endSeq = binary.BigEndian.AppendUint64(nil, ^uint64(0))

// entry is one published batch kept for replay.
type entry struct {
	seq     uint64
	payload []byte
}

// ring keeps the last n published batches, oldest first (vLLM's
// deque(maxlen=buffer_steps)).
type ring struct {
	mu      sync.Mutex
	entries []entry
	next    int // where the next entry goes once the ring is full
	n       int
}

func newRing(n int) *ring { return &ring{n: n} }

func (r *ring) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.entries) < r.n {
		r.entries = append(r.entries, entry{seq, payload})
		return
	}
	r.entries[r.next] = entry{seq, payload}
	r.next = (r.next + 1) % r.n
}

// since returns the kept batches with seq ≥ start, oldest first.
func (r *ring) since(start uint64) []entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []entry
	for i := range r.entries {
		e := r.entries[(r.next+i)%len(r.entries)]
		if e.seq >= start {
			out = append(out, e)
		}
	}
	return out
}

// serveReplay answers replay requests until ctx ends: a client sends the
// 8-byte big-endian seq to start from (the ROUTER sees
// [client_id, "", start]); the answer is every kept batch from it on,
// then the end marker, framed as ReplayFraming says. A malformed request
// is logged and ignored, as vLLM does.
func (p *Publisher) serveReplay(ctx context.Context) {
	for {
		msg, err := p.router.Recv()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			p.opts.Logger.Warn("kv events zmq publisher: replay receive failed", "err", err)
			continue
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			p.opts.Logger.Warn("kv events zmq publisher: invalid replay request", "frames", len(msg.Frames))
			continue
		}
		p.replay(msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2]))
	}
}

// replay sends one client the batches from start on and the end marker.
func (p *Publisher) replay(client []byte, start uint64) {
	p.opts.Metrics.replays.Inc()
	for _, e := range p.buf.since(start) {
		if err := p.router.SendMulti(p.replayMsg(client, binary.BigEndian.AppendUint64(nil, e.seq), e.payload)); err != nil {
			p.opts.Logger.Warn("kv events zmq publisher: replay send failed", "seq", e.seq, "err", err)
			return
		}
	}
	if err := p.router.SendMulti(p.replayMsg(client, endSeq, nil)); err != nil {
		p.opts.Logger.Warn("kv events zmq publisher: replay end marker not sent", "err", err)
	}
}

// replayMsg frames one reply: [client, "", topic, seq, payload] (topic
// framing; the end marker's topic is empty) or [client, "", seq, payload].
func (p *Publisher) replayMsg(client, seq, payload []byte) zmq4.Msg {
	if p.opts.ReplayFraming == FramingSeq {
		return zmq4.NewMsgFrom(client, nil, seq, payload)
	}
	topic := p.topic
	if payload == nil {
		topic = nil
	}
	return zmq4.NewMsgFrom(client, nil, topic, seq, payload)
}
