package retry_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/retry"
)

func TestDelayDoublesToTheCap(t *testing.T) {
	t.Parallel()
	b := retry.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	for n, want := range map[int]time.Duration{
		-1: 10 * time.Millisecond, 0: 10 * time.Millisecond, 1: 10 * time.Millisecond,
		2: 20 * time.Millisecond, 3: 40 * time.Millisecond, 4: 50 * time.Millisecond, 1000: 50 * time.Millisecond,
	} {
		if got := b.Delay(n); got != want {
			t.Errorf("Delay(%d) = %v, want %v", n, got, want)
		}
	}
	if got := (retry.Backoff{Initial: time.Second, Max: time.Millisecond}).Delay(3); got != time.Second {
		t.Errorf("Max below Initial: Delay(3) = %v, want Initial", got)
	}
}

func TestDelayJitterStaysInBounds(t *testing.T) {
	t.Parallel()
	b := retry.Backoff{Initial: 100 * time.Millisecond, Max: 400 * time.Millisecond, Jitter: 0.2}
	for range 200 {
		if d := b.Delay(2); d < 160*time.Millisecond || d > 240*time.Millisecond {
			t.Fatalf("Delay(2) = %v, want within 20%% of 200ms", d)
		}
		if d := b.Delay(10); d < 320*time.Millisecond || d > 400*time.Millisecond {
			t.Fatalf("Delay(10) = %v, want in [320ms, 400ms] (jitter capped at Max)", d)
		}
	}
}

func TestDoRetriesUntilSuccessOrPermanent(t *testing.T) {
	t.Parallel()
	b := retry.Backoff{Initial: time.Microsecond, Max: time.Microsecond}
	calls, notified := 0, 0
	got, err := retry.Do(t.Context(), b, func() (int, error) {
		calls++
		if calls < 3 {
			return 0, errors.New("transient")
		}
		return calls, nil
	}, func(error, time.Duration) { notified++ })
	if err != nil || got != 3 || notified != 2 {
		t.Errorf("Do = %d, %v after %d notifications; want 3, nil, 2", got, err, notified)
	}

	boom := errors.New("boom")
	calls = 0
	_, err = retry.Do(t.Context(), b, func() (int, error) { calls++; return 0, retry.Permanent(boom) }, nil)
	if !errors.Is(err, boom) || calls != 1 {
		t.Errorf("permanent: err %v after %d calls; want boom after 1", err, calls)
	}
}

func TestDoAndSleepStopWithTheContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	b := retry.Backoff{Initial: time.Hour, Max: time.Hour}
	_, err := retry.Do(ctx, b, func() (int, error) { return 0, errors.New("fails") },
		func(error, time.Duration) { cancel() })
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Do with ctx cancelled during the wait = %v, want context.Canceled", err)
	}
	if err := retry.Sleep(ctx, time.Hour); !errors.Is(err, context.Canceled) {
		t.Errorf("Sleep on a cancelled ctx = %v, want context.Canceled", err)
	}
	if err := retry.Sleep(t.Context(), time.Microsecond); err != nil {
		t.Errorf("Sleep(1µs) = %v, want nil", err)
	}
}

func TestAttemptsCountsAndReturnsTheLastError(t *testing.T) {
	t.Parallel()
	b := retry.Backoff{Initial: time.Microsecond, Max: time.Microsecond}
	var seen []int
	got, err := retry.Attempts(t.Context(), b, func(attempt int) (string, error) {
		seen = append(seen, attempt)
		if attempt < 3 {
			return "", errors.New("transient")
		}
		return "done", nil
	})
	if err != nil || got != "done" || len(seen) != 3 || seen[0] != 1 || seen[2] != 3 {
		t.Errorf("Attempts = %q, %v after attempts %v; want done, nil after 1..3", got, err, seen)
	}

	boom := errors.New("boom")
	calls := 0
	_, err = retry.Attempts(t.Context(), b, func(attempt int) (int, error) {
		calls++
		if attempt == 2 {
			return 0, retry.Permanent(boom)
		}
		return 0, errors.New("transient")
	})
	if err != boom || calls != 2 {
		t.Errorf("permanent: err %v after %d calls; want boom itself after 2", err, calls)
	}
}

func TestAttemptsReturnsOpsErrorWhenTheContextEnds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	fails := errors.New("fails")
	b := retry.Backoff{Initial: time.Hour, Max: time.Hour}
	_, err := retry.Attempts(ctx, b, func(int) (int, error) { cancel(); return 0, fails })
	if err != fails {
		t.Errorf("Attempts with ctx cancelled = %v, want op's error", err)
	}
}

func TestPolicy(t *testing.T) {
	p := retry.Policy{MaxAttempts: 3, Backoff: retry.Backoff{Initial: 10 * time.Millisecond, Max: 25 * time.Millisecond}}
	for _, tc := range []struct {
		attempts  int
		exhausted bool
		delay     time.Duration
	}{
		{1, false, 10 * time.Millisecond},
		{2, false, 20 * time.Millisecond},
		{3, true, 25 * time.Millisecond},
		{4, true, 25 * time.Millisecond},
	} {
		if got := p.Exhausted(tc.attempts); got != tc.exhausted {
			t.Errorf("Exhausted(%d) = %v, want %v", tc.attempts, got, tc.exhausted)
		}
		if got := p.Delay(tc.attempts); got != tc.delay {
			t.Errorf("Delay(%d) = %v, want %v", tc.attempts, got, tc.delay)
		}
	}
}
