package bus

import (
	"context"
	"hash/fnv"
	"strconv"
	"sync"

	"github.com/segmentio/kafka-go"
)

// consumeConcurrently runs Concurrency lanes: it fetches records ahead,
// hands each to the lane of its key, and commits each partition's offsets
// up to its first record not yet settled, until ctx ends or the reader
// fails. On the way out it interrupts the lanes' handlers (through ctx, or
// by cancelling them after a reader error), waits for the lanes, and
// commits the settled prefix of every partition.
func (c *Consumer) consumeConcurrently(ctx context.Context, r *kafka.Reader) error {
	n := c.cfg.Concurrency
	t := newTracker(2 * n * n)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	lanes := make([]chan *pending, n)
	var wg sync.WaitGroup
	for i := range lanes {
		// The window bounds the records queued on all lanes together, so a
		// send to a lane never blocks.
		lanes[i] = make(chan *pending, cap(t.slots))
		wg.Go(func() { c.runLane(lctx, lanes[i], t) })
	}
	committed := make(chan struct{})
	go func() {
		defer close(committed)
		c.commitLoop(lctx, r, t)
	}()

	err := c.dispatch(ctx, r, t, lanes)
	cancel()
	for _, l := range lanes {
		close(l)
	}
	wg.Wait()
	<-committed
	c.commitWatermarks(ctx, r, t)
	return err
}

// dispatch fetches records while the window has room and queues each on
// its lane, until ctx ends (nil) or the reader fails.
func (c *Consumer) dispatch(ctx context.Context, r *kafka.Reader, t *tracker, lanes []chan *pending) error {
	var failures int
	for {
		select {
		case t.slots <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		m, err := r.FetchMessage(ctx)
		for err != nil { // the slot stays taken while the fetch is retried
			if ctx.Err() != nil || !c.fetchFailed(ctx, err, &failures) {
				return nil
			}
			m, err = r.FetchMessage(ctx)
		}
		c.fetched(&failures)
		lanes[laneOf(m, len(lanes))] <- t.add(m)
	}
}

// laneOf picks the lane of m among n: by a hash of its key, or of its topic
// and partition when it has no key.
func laneOf(m kafka.Message, n int) int {
	h := fnv.New32a()
	if len(m.Key) > 0 {
		_, _ = h.Write(m.Key)
	} else {
		_, _ = h.Write([]byte(m.Topic))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(strconv.Itoa(m.Partition)))
	}
	return int(h.Sum32() % uint32(n))
}

// runLane settles the records queued on in, one at a time and in order,
// until in is closed. Once ctx has ended it drops what is left: those
// records stay unsettled, so they are not committed and the group delivers
// them again.
func (c *Consumer) runLane(ctx context.Context, in <-chan *pending, t *tracker) {
	for p := range in {
		if ctx.Err() != nil {
			continue
		}
		if c.settle(ctx, p.rec) {
			t.settle(p)
		}
	}
}

// commitLoop commits the watermarks each time one advances, until ctx ends.
// Being the only committer while the lanes run keeps the commits of a
// partition in increasing order.
func (c *Consumer) commitLoop(ctx context.Context, r *kafka.Reader, t *tracker) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.advanced:
			c.commitWatermarks(ctx, r, t)
		}
	}
}

// commitWatermarks commits, in one request, the watermark of each partition
// that advanced past its last commit.
func (c *Consumer) commitWatermarks(ctx context.Context, r *kafka.Reader, t *tracker) {
	msgs := t.uncommitted()
	if len(msgs) > 0 && c.commit(ctx, r, msgs...) {
		t.committed(msgs)
	}
}

// tracker follows the records fetched by a concurrent consumer and the
// watermark of each partition: the offset below which every fetched record
// is settled.
type tracker struct {
	// slots holds one token per record fetched and not yet below its
	// partition's watermark; its capacity is the fetch-ahead window.
	slots chan struct{}
	// advanced is signalled (without blocking) when a watermark advances.
	advanced chan struct{}

	mu    sync.Mutex
	parts map[partitionKey]*partitionState
}

type partitionKey struct {
	topic     string
	partition int
}

// partitionState is one partition's records in fetch order. Within one
// assignment a partition's records are fetched in offset order, starting at
// its committed offset, so when the settled prefix of queue ends just below
// offset o, every record below o is settled. A rebalance can deliver
// records again; a re-delivered record is queued after the first copy and
// settles after it (both go to the same lane), and the watermark never moves
// back.
type partitionState struct {
	key   partitionKey
	queue []*pending
	// done is the offset after the settled prefix; -1 before any.
	done int64
	// sent is the last offset committed; -1 before any.
	sent int64
}

// pending is one fetched record on its way through a lane.
type pending struct {
	rec     Received
	offset  int64
	part    *partitionState
	settled bool
}

func newTracker(window int) *tracker {
	return &tracker{
		slots:    make(chan struct{}, window),
		advanced: make(chan struct{}, 1),
		parts:    map[partitionKey]*partitionState{},
	}
}

// add queues m on its partition; its slot is already taken.
func (t *tracker) add(m kafka.Message) *pending {
	t.mu.Lock()
	defer t.mu.Unlock()
	k := partitionKey{topic: m.Topic, partition: m.Partition}
	ps, ok := t.parts[k]
	if !ok {
		ps = &partitionState{key: k, done: -1, sent: -1}
		t.parts[k] = ps
	}
	p := &pending{rec: received(m), offset: m.Offset, part: ps}
	ps.queue = append(ps.queue, p)
	return p
}

// settle marks p settled and advances its partition's watermark over the
// settled prefix, freeing their slots.
func (t *tracker) settle(p *pending) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p.settled, p.rec = true, Received{} // the value is no longer needed
	ps := p.part
	moved := false
	for len(ps.queue) > 0 && ps.queue[0].settled {
		head := ps.queue[0]
		ps.queue[0] = nil
		ps.queue = ps.queue[1:]
		<-t.slots
		if head.offset+1 > ps.done {
			ps.done, moved = head.offset+1, true
		}
	}
	if moved && ps.done > ps.sent {
		select {
		case t.advanced <- struct{}{}:
		default:
		}
	}
}

// uncommitted returns, as kafka-go commits them (the offset of the last
// settled record), the watermarks that moved past their last commit.
func (t *tracker) uncommitted() []kafka.Message {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []kafka.Message
	for _, ps := range t.parts {
		if ps.done > ps.sent {
			out = append(out, kafka.Message{Topic: ps.key.topic, Partition: ps.key.partition, Offset: ps.done - 1})
		}
	}
	return out
}

// committed records msgs (from uncommitted) as committed.
func (t *tracker) committed(msgs []kafka.Message) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, m := range msgs {
		ps := t.parts[partitionKey{topic: m.Topic, partition: m.Partition}]
		ps.sent = max(ps.sent, m.Offset+1)
	}
}
