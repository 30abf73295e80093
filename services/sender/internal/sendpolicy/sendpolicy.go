// Package sendpolicy holds the sender's pure policies: the store-pressure
// gate (PressureGate: which saves to skip while a request's puts are
// answered "no space"), the retry policy of its store and worker calls
// (RetryPolicy) and a tenant quota's arithmetic (QuotaLimit: what fits,
// and Victims: which of the tenant's keys leave to make room). All are
// values: no I/O, and time is passed in, never
// read. Only the sender uses them; the shared domain core (kvcore) keeps
// what the other services read too (reason codes, SaveStatus).
package sendpolicy

import (
	"maps"
	"strconv"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// Defaults of the sender's policies.
const (
	// DefaultProbeEvery is how many skipped saves of a request under
	// pressure the gate lets pass before it lets one through as a probe.
	DefaultProbeEvery = 16
	// DefaultPressureCoolDown is how long the gate waits before it lets a
	// probe of a request under pressure through regardless of its skips.
	DefaultPressureCoolDown = 5 * time.Second
	// DefaultMaxPressureScopes bounds the requests the gate holds under
	// pressure at once; past it the longest-waiting one is let go (its next
	// save is put as usual).
	DefaultMaxPressureScopes = 4096
	// DefaultRetryAttempts is the number of attempts (the first included)
	// before a failing store call is given up.
	DefaultRetryAttempts = 4
	// DefaultRetryBase is the delay before the first retry.
	DefaultRetryBase = 50 * time.Millisecond
	// DefaultRetryMax caps the delay between retries.
	DefaultRetryMax = 2 * time.Second
)

// Admission is the pressure gate's answer for one save task.
type Admission string

// Admissions.
const (
	// AdmitPut: the task's request is not under pressure; put as usual.
	AdmitPut Admission = "put"
	// AdmitProbe: the request is under pressure, and this task goes
	// through to test whether the store has room again.
	AdmitProbe Admission = "probe"
	// AdmitSkip: the request is under pressure; skip the save (count and
	// report it; the tracker saves the range again with the request's next
	// save).
	AdmitSkip Admission = "skip"
)

// PressureScopeOf names the scope a "no space" answer to task t puts under
// pressure: its request, of its engine, in its allocation epoch. A save of
// an earlier epoch (a stale task) so never sentences the resumed request's
// saves, as in vLLM only a live store job may mark its request skipped.
func PressureScopeOf(t *kvcore.SaveTask) string {
	return strconv.Quote(t.EngineID) + " " + strconv.Quote(t.RequestID) + " " + strconv.Itoa(t.Epoch)
}

// PressureScope is one request under pressure.
type PressureScope struct {
	// SinceProbe counts the request's skips since it came under pressure or
	// its last probe.
	SinceProbe int `json:"since_probe"`
	// LastProbe is when the request came under pressure, its last probe
	// went out or the store last answered it "no space".
	LastProbe time.Time `json:"last_probe"`
}

// PressureGate is the sender's store-pressure rule, vLLM's
// (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py,
// KVCacheStoreSendingThread: _mark_request_skipped_for_pressure,
// _should_skip_request, _clear_store_pressure): a "no space" answer puts
// only the request whose put got it under pressure (its scope,
// PressureScopeOf), and only that request's later saves are skipped (and
// counted); every other request's saves are put as usual. The first put
// that succeeds, of any request, shows the store has room again and lets
// every request go. So that a request under pressure is not stuck when no
// other request puts, one of its saves is let through as a probe every
// ProbeEvery of its skips, or once CoolDown has passed since it came under
// pressure or its last probe (kvmesh's addition). A skipped save is never
// counted as saved: the tracker learns it from the save result and covers
// the range again with the request's next save. It is a pure value: time is
// passed in, never read.
type PressureGate struct {
	// ProbeEvery is the number of skips between probes (0: DefaultProbeEvery).
	ProbeEvery int `json:"probe_every,omitempty"`
	// CoolDown is the longest wait between probes (0: DefaultPressureCoolDown).
	CoolDown time.Duration `json:"cool_down,omitempty"`
	// MaxScopes bounds Scopes (0: DefaultMaxPressureScopes).
	MaxScopes int `json:"max_scopes,omitempty"`
	// Scopes are the requests under pressure, by PressureScopeOf.
	Scopes map[string]PressureScope `json:"scopes,omitempty"`
	// Skipped counts every skipped task.
	Skipped int64 `json:"skipped"`
	// Episodes counts how many times pressure began (no request under
	// pressure before).
	Episodes int64 `json:"episodes"`
	// Released counts the requests let go to stay within MaxScopes.
	Released int64 `json:"released,omitempty"`
}

// Admit decides what to do at time now with the next save task of scope.
func (g *PressureGate) Admit(scope string, now time.Time) Admission {
	s, ok := g.Scopes[scope]
	if !ok {
		return AdmitPut
	}
	every, cool := g.ProbeEvery, g.CoolDown
	if every <= 0 {
		every = DefaultProbeEvery
	}
	if cool <= 0 {
		cool = DefaultPressureCoolDown
	}
	if s.SinceProbe >= every || now.Sub(s.LastProbe) >= cool {
		g.Scopes[scope] = PressureScope{LastProbe: now}
		return AdmitProbe
	}
	s.SinceProbe++
	g.Scopes[scope] = s
	g.Skipped++
	return AdmitSkip
}

// OnNoSpace records a "no space" answer from the store to a put of scope:
// the request comes under pressure (or stays, its cool-down restarted).
func (g *PressureGate) OnNoSpace(scope string, now time.Time) {
	if !g.Active() {
		g.Episodes++
	}
	if g.Scopes == nil {
		g.Scopes = map[string]PressureScope{}
	}
	s, ok := g.Scopes[scope]
	if !ok {
		g.makeRoom()
	}
	s.LastProbe = now
	g.Scopes[scope] = s
}

// makeRoom lets go of the request waiting longest (the oldest LastProbe)
// when Scopes is full, so the gate's memory stays bounded; that request's
// next save is put as usual and may bring it back.
func (g *PressureGate) makeRoom() {
	limit := g.MaxScopes
	if limit <= 0 {
		limit = DefaultMaxPressureScopes
	}
	for len(g.Scopes) >= limit {
		var oldest string
		var at time.Time
		first := true
		for k, s := range g.Scopes {
			if first || s.LastProbe.Before(at) || (s.LastProbe.Equal(at) && k < oldest) {
				oldest, at, first = k, s.LastProbe, false
			}
		}
		delete(g.Scopes, oldest)
		g.Released++
	}
}

// OnPutOK records a successful put: the store has room, and every request
// is let go (vLLM's _clear_store_pressure).
func (g *PressureGate) OnPutOK() {
	g.Scopes = nil
}

// Active reports whether some request is under pressure.
func (g *PressureGate) Active() bool { return len(g.Scopes) > 0 }

// UnderPressure is the number of requests under pressure.
func (g *PressureGate) UnderPressure() int { return len(g.Scopes) }

// Clone returns a copy of g that shares nothing with it.
func (g *PressureGate) Clone() PressureGate {
	c := *g
	c.Scopes = maps.Clone(g.Scopes)
	return c
}

// RetryAction is what to do after a failed store call.
type RetryAction string

// Retry actions.
const (
	// RetryAgain: retry after RetryDecision.Delay.
	RetryAgain RetryAction = "retry"
	// RetryDeadLetter: give up and dead-letter the group with the reason.
	RetryDeadLetter RetryAction = "dead_letter"
	// RetryFail: give up and report the group failed with the reason.
	RetryFail RetryAction = "fail"
)

// RetryDecision is the policy's answer after a failed attempt.
type RetryDecision struct {
	// Action says whether to retry or how to give up.
	Action RetryAction `json:"action"`
	// Delay is the backoff before the retry (RetryAgain only).
	Delay time.Duration `json:"delay,omitempty"`
	// Reason is the reason code when giving up.
	Reason kvcore.Reason `json:"reason,omitempty"`
}

// RetryPolicy is the sender's retry settings and what it does when they
// are used up (ExistsFailed, PutFailed); the retrying itself is pkg/retry's
// (Policy). The delay before retry n
// (n ≥ 1) is BaseDelay·2^(n−1), capped at MaxDelay (pkg/retry's Backoff,
// see Delays); after MaxAttempts attempts the call is given up. No jitter
// and no sleeping: values only.
type RetryPolicy struct {
	// MaxAttempts counts the first attempt too (0: DefaultRetryAttempts).
	MaxAttempts int `json:"max_attempts,omitempty"`
	// BaseDelay is the first retry's delay (0: DefaultRetryBase).
	BaseDelay time.Duration `json:"base_delay,omitempty"`
	// MaxDelay caps every delay (0: DefaultRetryMax).
	MaxDelay time.Duration `json:"max_delay,omitempty"`
}

// ExistsFailed decides after attempts failed existence checks of one task:
// retry with backoff, or dead-letter with ReasonExistsFailed.
func (p RetryPolicy) ExistsFailed(attempts int) RetryDecision {
	return p.decide(attempts, RetryDeadLetter, kvcore.ReasonExistsFailed)
}

// PutFailed decides after attempts failed puts (other than "no space"):
// retry with backoff, or report the group failed with ReasonPutFailed.
func (p RetryPolicy) PutFailed(attempts int) RetryDecision {
	return p.decide(attempts, RetryFail, kvcore.ReasonPutFailed)
}

// decide retries until MaxAttempts, then gives up with giveUp and reason.
func (p RetryPolicy) decide(attempts int, giveUp RetryAction, reason kvcore.Reason) RetryDecision {
	pol := p.Policy()
	if pol.Exhausted(attempts) {
		return RetryDecision{Action: giveUp, Reason: reason}
	}
	return RetryDecision{Action: RetryAgain, Delay: pol.Delay(attempts)}
}

// Policy is the settings with their defaults as the one retry.Policy.
func (p RetryPolicy) Policy() retry.Policy {
	return retry.Policy{MaxAttempts: p.Attempts(), Backoff: p.Delays()}
}

// Attempts is the number of attempts the policy allows, the first
// included.
func (p RetryPolicy) Attempts() int {
	if p.MaxAttempts > 0 {
		return p.MaxAttempts
	}
	return DefaultRetryAttempts
}

// Delays is the policy's backoff as a retry.Backoff, without jitter, for
// retry.Attempts: BaseDelay doubling up to MaxDelay (defaults for zero
// values; a BaseDelay above MaxDelay starts at MaxDelay).
func (p RetryPolicy) Delays() retry.Backoff {
	base, ceil := p.BaseDelay, p.MaxDelay
	if base <= 0 {
		base = DefaultRetryBase
	}
	if ceil <= 0 {
		ceil = DefaultRetryMax
	}
	return retry.Backoff{Initial: min(base, ceil), Max: ceil}
}
