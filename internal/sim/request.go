package sim

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// phase is where a request is in its engine.
type phase int

const (
	// phaseWaiting: queued; needs a lookup and an allocation.
	phaseWaiting phase = iota
	// phaseLoading: allocated with external tokens; waiting for finished_recving.
	phaseLoading
	// phaseAllocated: allocated (and loaded, if it had to be); queued to be scheduled.
	phaseAllocated
	// phaseRunning: scheduled; computes a chunk of prefill or one decode token per step.
	phaseRunning
	// phaseFinishing: finished generating; its blocks wait for finished_sending.
	phaseFinishing
	// phaseDone: freed; nothing left.
	phaseDone
)

// request is one request as the simulated engine sees it.
type request struct {
	id     string
	engine string
	turn   *turnState
	ctx    context.Context
	span   trace.Span
	// traceparent is the W3C trace context of span, carried by each of the
	// request's events (empty without a propagator).
	traceparent string

	prompt    []uint32
	output    []uint32 // the reply; output[:generated] are generated
	maxOut    int      // tokens to generate (1 on a prefill engine)
	generated int
	salt      []byte // extra bytes of every block hash
	tenant    string // the conversation's tenant (Conversation.Tenant)
	hashes    []kvcore.BlockHash
	hexes     []string

	seq       int64
	phase     phase
	admitted  bool // the admitted event was published
	scheduled bool // a new step was published (later schedulings are resumed)
	decoding  bool // the current attempt sampled its first token
	table     kvcore.BlockTable
	computed  int
	load      *expectedLoad
	pd        *contract.PDSource // kv_transfer_params (decode engine, first attempt)
	shadow    *requeststate.Tracker

	arrived, since time.Time // since: entered the current phase
	firstToken     time.Time
	// lookupFailingSince is when the lookups of the current attempt began
	// failing (zero while they do not); lookupRetryAt when the next may be
	// sent, lookupFailures how many failed in a row.
	lookupFailingSince, lookupRetryAt time.Time
	lookupFailures                    int
	failure                           string
	// deadRank names the engine/rank whose death failed the request
	// (failure then says so), empty otherwise.
	deadRank    string
	holdForPeer bool // prefill engine: keep the blocks until the decode engine read them
	sent        bool // finished_sending arrived
	leak        bool // given up: its blocks stay allocated, since a late transfer may still use them
}

// expectedLoad is the load the engine accepted and waits for.
type expectedLoad struct {
	connector  string
	start, end int
	groups     []kvcore.GroupChunks
}

func (r *request) numTokens() int { return len(r.prompt) + r.generated }

func (r *request) token(i int) uint32 {
	if i < len(r.prompt) {
		return r.prompt[i]
	}
	return r.output[i-len(r.prompt)]
}

// admittedTokens are the token ids an admitted event carries: the
// prompt's tokens of complete hash blocks that the chain so far covers, at
// most kvcore.MaxTokenIDs of them (kvcore.TokenPrefix), as vLLM's
// connector sends them (a copy: the event is published as is).
func (r *request) admittedTokens(hbs int) []uint32 {
	n := min(len(r.prompt)/hbs, len(r.hexes)) * hbs
	if n == 0 {
		return nil
	}
	return append([]uint32(nil), kvcore.TokenPrefix(hbs, r.prompt[:n])...)
}

// extendHashes hashes every full hash block of the tokens so far.
func (r *request) extendHashes(hbs int) {
	buf := make([]uint32, hbs)
	for n := r.numTokens() / hbs; len(r.hashes) < n; {
		i := len(r.hashes)
		for j := range buf {
			buf[j] = r.token(i*hbs + j)
		}
		var parent kvcore.BlockHash
		if i > 0 {
			parent = r.hashes[i-1]
		}
		h := kvcore.HashTokens(parent, buf, r.salt)
		r.hashes = append(r.hashes, h)
		r.hexes = append(r.hexes, h.Hex())
	}
}

// lookupRetry books a failed lookup at now and reports whether another may
// be tried within timeout of the first failure; if so, lookupRetryAt is set
// after the next backoff (the retry delays, capped at the time left).
func (r *request) lookupRetry(now time.Time, timeout time.Duration) bool {
	if r.lookupFailingSince.IsZero() {
		r.lookupFailingSince = now
	}
	left := r.lookupFailingSince.Add(timeout).Sub(now)
	if left <= 0 {
		return false
	}
	r.lookupFailures++
	r.lookupRetryAt = now.Add(min(retryBackoff.Delay(r.lookupFailures), left))
	return true
}

// fail records the request's first failure; the request still runs to its end.
func (r *request) fail(reason string) {
	if r.failure == "" {
		r.failure = reason
	}
}

// turnState is one user request (a conversation turn) across the engines
// that serve it: one engine, or a prefill and a decode engine.
type turnState struct {
	ctx     context.Context
	span    trace.Span
	conv    *Conversation
	pair    *pair // the engines that serve it
	index   int
	id      string
	parts   int // engine requests not finalized yet
	arrived time.Time
	failed  []string
	// deadRank names the first engine/rank whose death failed a part of
	// the turn, empty when none did.
	deadRank string
}
