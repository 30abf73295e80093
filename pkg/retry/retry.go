// Package retry is kvmesh's one way of waiting between attempts: bounded
// exponential backoff from cenkalti/backoff/v5, a retry loop over it, and a
// sleep that ends early when its context does.
package retry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v5"
)

// maxSteps bounds how far Delay steps the library's backoff: 64 doublings
// take any positive Initial past any Max.
const maxSteps = 64

// Backoff is a bounded exponential backoff: the delay before retry n
// (n ≥ 1) is Initial doubled n-1 times, capped at Max, then moved by up to
// ±Jitter of itself and capped at Max again.
type Backoff struct {
	// Initial is the delay before the first retry; it must be positive.
	Initial time.Duration
	// Max caps every delay; a value below Initial counts as Initial.
	Max time.Duration
	// Jitter is the randomization factor in [0, 1); 0 means none, and the
	// delays are then a function of n alone.
	Jitter float64
}

// Policy is a bounded retry: at most MaxAttempts calls, the first
// included, with Backoff's delays between them. It is the one shape of a
// retry's settings (the consumers' in pkg/bus, the sender's save calls).
type Policy struct {
	// MaxAttempts counts the first attempt too; 1 means no retry.
	MaxAttempts int
	// Backoff spaces the attempts.
	Backoff Backoff
}

// Exhausted reports whether attempts failed calls use up the policy.
func (p Policy) Exhausted(attempts int) bool { return attempts >= p.MaxAttempts }

// Delay is the wait before retry n (n < 1 counts as 1).
func (p Policy) Delay(n int) time.Duration { return p.Backoff.Delay(n) }

// BackOff returns a fresh cenkalti/backoff iterator for b, for
// backoff.Retry or anything else that takes a backoff.BackOff.
func (b Backoff) BackOff() backoff.BackOff {
	return cappedBackOff{exp: b.exponential(), max: b.ceiling()}
}

// Delay returns the delay before retry n (n < 1 counts as 1), as the n-th
// value of b's iterator.
func (b Backoff) Delay(n int) time.Duration {
	it := b.BackOff()
	d := it.NextBackOff()
	for i := 1; i < min(n, maxSteps); i++ {
		d = it.NextBackOff()
	}
	return d
}

// exponential returns the library's iterator configured for b.
func (b Backoff) exponential() *backoff.ExponentialBackOff {
	e := &backoff.ExponentialBackOff{
		InitialInterval:     b.Initial,
		RandomizationFactor: b.Jitter,
		Multiplier:          2,
		MaxInterval:         b.ceiling(),
	}
	e.Reset()
	return e
}

// ceiling is b's effective cap.
func (b Backoff) ceiling() time.Duration { return max(b.Max, b.Initial) }

// cappedBackOff caps the library's jittered values at max: the library caps
// the interval before jitter, so its values can exceed MaxInterval.
type cappedBackOff struct {
	exp *backoff.ExponentialBackOff
	max time.Duration
}

// NextBackOff returns the next delay, at most max.
func (c cappedBackOff) NextBackOff() time.Duration { return min(c.exp.NextBackOff(), c.max) }

// Reset starts the sequence again from Initial.
func (c cappedBackOff) Reset() { c.exp.Reset() }

// Permanent marks err as not worth retrying: Do returns it (unwrapped) at
// once.
func Permanent(err error) error { return backoff.Permanent(err) }

// Do calls op until it succeeds, returns a Permanent error, or ctx ends,
// waiting b's delays between calls; there is no limit on tries or elapsed
// time other than ctx and op's own decisions. Before each wait, notify (if
// not nil) receives op's error and the delay. A ctx that ends makes Do
// return context.Cause(ctx).
func Do[T any](ctx context.Context, b Backoff, op func() (T, error), notify func(err error, delay time.Duration)) (T, error) {
	opts := []backoff.RetryOption{backoff.WithBackOff(b.BackOff()), backoff.WithMaxElapsedTime(0)}
	if notify != nil {
		opts = append(opts, backoff.WithNotify(notify))
	}
	v, err := backoff.Retry(ctx, op, opts...)
	if err != nil {
		return v, fmt.Errorf("retry: %w", err)
	}
	return v, nil
}

// Attempts is Do for a caller that counts its attempts and wants op's own
// error back: op receives the attempt number (1 for the first call) and
// bounds the attempts itself by returning a Permanent error. On failure
// Attempts returns op's last error as op returned it (a Permanent one
// unwrapped), not wrapped and not the context's cause, also when ctx ended
// before or during a wait; a caller that needs to know asks ctx.
func Attempts[T any](ctx context.Context, b Backoff, op func(attempt int) (T, error)) (T, error) {
	attempt := 0
	var last error
	v, err := Do(ctx, b, func() (T, error) {
		attempt++
		v, err := op(attempt)
		last = err
		return v, err
	}, nil)
	if err == nil {
		return v, nil
	}
	if perm := (*backoff.PermanentError)(nil); errors.As(last, &perm) {
		last = perm.Unwrap()
	}
	return v, last
}

// Sleep waits for d, or until ctx ends, in which case it returns
// context.Cause(ctx). d ≤ 0 returns at once (nil unless ctx has ended).
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return context.Cause(ctx)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}
