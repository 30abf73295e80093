// Package kvpublish publishes kvmesh's KV events (kvmesh.kv.events) on a
// ZeroMQ PUB socket exactly as a vLLM pod publishes its own
// (vllm/distributed/kv_events.py, ZmqEventPublisher), so a KV-aware router
// that subscribes to vLLM pods (llm-d's kvevents ZMQ subscriber) indexes
// the blocks the store holds as one more pod's.
//
// Kafka stays the durable source: the publisher is a bus handler
// (Publisher.Handle) of a consumer of the topic that starts at its oldest
// retained record; it keeps the records of one deployment's model and one
// tenant key space, re-encodes each batch in the configured wire form and
// sends it as the multipart message
// [topic "kv@<pod>@<model>", 8-byte big-endian seq, payload], seq counting
// from 0 per publisher. An optional ROUTER socket answers vLLM's replay
// requests from a buffer of the last batches.
package kvpublish

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Defaults of Options.
const (
	// DefaultPod is the pod identifier of the topic: the store, indexed by
	// the router as one more pod.
	DefaultPod = "kvmesh-store"
	// DefaultBufferSteps is the batches kept for replay (vLLM's
	// buffer_steps default).
	DefaultBufferSteps = 10_000
	// DefaultHWM is the PUB socket's high-water mark (vLLM's hwm default).
	DefaultHWM = 100_000
)

// Sentinel errors of the package.
var (
	// ErrOptions reports Options that cannot work.
	ErrOptions = errors.New("kvpublish: invalid options")
	// ErrReplayFraming reports a replay framing other than topic or seq.
	ErrReplayFraming = errors.New("kvpublish: unknown replay framing")
)

// ReplayFraming is how the ROUTER socket frames a replayed batch; vLLM has
// changed it once.
type ReplayFraming string

// The replay framings.
const (
	// FramingTopic is vLLM's current framing (the 2026-08 tree): each
	// batch [client_id, "", topic, seq, payload], then the end marker
	// [client_id, "", "", END_SEQ, ""]. The default.
	FramingTopic ReplayFraming = "topic"
	// FramingSeq is vLLM's earlier framing (the 2026-05 tree, the array_like
	// events' time): [client_id, "", seq, payload], then
	// [client_id, "", END_SEQ, ""].
	FramingSeq ReplayFraming = "seq"
)

// Validate reports a framing other than topic, seq or "" (topic).
func (f ReplayFraming) Validate() error {
	switch f {
	case "", FramingTopic, FramingSeq:
		return nil
	}
	return fmt.Errorf("replay framing %q (want topic or seq): %w", string(f), ErrReplayFraming)
}

// UnmarshalText reads a framing name, refusing any other value.
func (f *ReplayFraming) UnmarshalText(b []byte) error {
	v := ReplayFraming(b)
	if err := v.Validate(); err != nil {
		return err
	}
	if v == "" {
		v = FramingTopic
	}
	*f = v
	return nil
}

// Options configures a Publisher.
type Options struct {
	// Keys is the deployment's key space (prefix and model): records of
	// another model or prefix are skipped.
	Keys kvcore.KeyBuilder
	// Tenant is the one tenant key space published ("" the tenant-less
	// one): token ids in events are prompt content, so one endpoint never
	// mixes tenants.
	Tenant string
	// Model is the model name of the topic (default Keys.Model): the name
	// the router scores requests with.
	Model string
	// Pod is the pod identifier of the topic (default DefaultPod).
	Pod string
	// Form is the wire form of the published batches' events ("" map).
	Form contract.KVEventForm
	// Endpoint is the PUB socket's bind address, e.g. tcp://*:5557.
	Endpoint string
	// ReplayEndpoint is the ROUTER socket's bind address; "" for none.
	ReplayEndpoint string
	// ReplayFraming is the replay replies' framing (default FramingTopic).
	ReplayFraming ReplayFraming
	// BufferSteps is the batches kept for replay (default DefaultBufferSteps).
	BufferSteps int
	// ClearAsRemoved follows each AllBlocksCleared with BlockRemoved events
	// of every hash announced stored and not removed since the publisher
	// started, for routers that ignore AllBlocksCleared (llm-d-kv-cache
	// v0.8.1 only logs it), from the set of live hashes the publisher keeps
	// anyway (to order parents before children).
	ClearAsRemoved bool
	// HoldFor is how long a BlockStored event whose parent block was not
	// announced yet waits for it (0: DefaultHoldFor; negative: no event
	// waits, every record goes in Kafka's order).
	HoldFor time.Duration
	// Metrics receives the publisher's counters (required).
	Metrics *Metrics
	// Logger receives decode failures and reader errors (default discard).
	Logger *slog.Logger
}

// validate checks o.
func (o Options) validate() error {
	var errs []error
	if o.Endpoint == "" || o.Metrics == nil {
		errs = append(errs, errors.New("endpoint and metrics are required"))
	}
	if err := o.Keys.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := kvcore.ValidateTenant(o.Tenant); err != nil {
		errs = append(errs, err)
	}
	if o.BufferSteps < 0 {
		errs = append(errs, fmt.Errorf("buffer steps %d is negative", o.BufferSteps))
	}
	errs = append(errs, o.Form.Validate(), o.ReplayFraming.Validate())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrOptions, err)
	}
	return nil
}

// withDefaults fills the zero fields of o that have defaults.
func (o Options) withDefaults() Options {
	if o.Model == "" {
		o.Model = o.Keys.Model
	}
	if o.Pod == "" {
		o.Pod = DefaultPod
	}
	if o.Form == "" {
		o.Form = contract.KVEventFormMap
	}
	if o.ReplayFraming == "" {
		o.ReplayFraming = FramingTopic
	}
	if o.BufferSteps == 0 {
		o.BufferSteps = DefaultBufferSteps
	}
	if o.HoldFor == 0 {
		o.HoldFor = DefaultHoldFor
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Publisher republishes kvmesh.kv.events on ZMQ. New binds its sockets;
// Handle publishes each record a consumer hands it; Run answers replay
// requests until its context ends, then closes the sockets.
type Publisher struct {
	opts   Options
	topic  []byte
	pub    zmq4.Socket
	router zmq4.Socket // nil without a replay endpoint
	cancel context.CancelFunc
	buf    *ring
	close  sync.Once
	// mu guards what Handle and the expiry of held events share: the next
	// batch's sequence number, the live hashes and the held events.
	mu      sync.Mutex
	seq     uint64
	live    live
	waiting []waiting
}

// New checks opts and binds the PUB (and ROUTER) sockets.
func New(opts Options) (*Publisher, error) {
	if err := opts.validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{
		opts: opts, topic: []byte("kv@" + opts.Pod + "@" + opts.Model), cancel: cancel,
		buf: newRing(opts.BufferSteps), live: live{},
	}
	p.pub = zmq4.NewPub(ctx)
	if err := p.pub.SetOption(zmq4.OptionHWM, DefaultHWM); err != nil {
		p.Close()
		return nil, fmt.Errorf("kv events zmq publisher: high-water mark: %w", err)
	}
	if err := p.pub.Listen(opts.Endpoint); err != nil {
		p.Close()
		return nil, fmt.Errorf("kv events zmq publisher: bind %s: %w", opts.Endpoint, err)
	}
	if opts.ReplayEndpoint != "" {
		p.router = zmq4.NewRouter(ctx)
		if err := p.router.Listen(opts.ReplayEndpoint); err != nil {
			p.Close()
			return nil, fmt.Errorf("kv events zmq publisher: bind replay %s: %w", opts.ReplayEndpoint, err)
		}
	}
	return p, nil
}

// Topic is the ZMQ topic of every published batch: kv@<pod>@<model>.
func (p *Publisher) Topic() string { return string(p.topic) }

// Addr is the PUB socket's bound address (its port when bound to port 0).
func (p *Publisher) Addr() string { return p.pub.Addr().String() }

// ReplayAddr is the ROUTER socket's bound address; "" without one.
func (p *Publisher) ReplayAddr() string {
	if p.router == nil {
		return ""
	}
	return p.router.Addr().String()
}

// Close closes the sockets; Run closes them when it returns. (go-zeromq/zmq4
// v0.17.0 leaves one goroutine of each PUB socket running after Close: its
// writer's, which the socket never closes.)
func (p *Publisher) Close() {
	p.close.Do(func() {
		p.cancel()
		_ = p.pub.Close()
		if p.router != nil {
			_ = p.router.Close()
		}
	})
}

// Run answers replay requests (with a replay endpoint) and publishes the
// held events whose hold expired until ctx ends, then closes the sockets;
// it returns nil then. Handle may publish
// meanwhile; after Run returned it publishes nothing more.
func (p *Publisher) Run(ctx context.Context) error {
	defer p.Close()
	stop := context.AfterFunc(ctx, p.Close) // unblocks the ROUTER's Recv
	defer stop()
	var expiry sync.WaitGroup
	expiry.Go(func() { p.expireHeld(ctx) })
	if p.router != nil {
		p.serveReplay(ctx)
	}
	<-ctx.Done()
	expiry.Wait()
	return nil
}
