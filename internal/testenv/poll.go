package testenv

import (
	"testing"
	"time"
)

// PollEvery is how often Eventually checks its condition.
const PollEvery = 10 * time.Millisecond

// Eventually checks cond every PollEvery until it holds, failing the test
// with what when it still does not after within: the deadline-bound poll
// tests use instead of sleeping.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	tick := time.NewTicker(PollEvery)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not seen in %v", what, within)
		}
		<-tick.C
	}
}
