package sendpolicy

import (
	"encoding/json"
	"math"
	"reflect"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func TestPressureGateDefaults(t *testing.T) {
	var g PressureGate
	now := time.Unix(0, 0).UTC()
	if g.Admit("a", now) != AdmitPut {
		t.Fatal("no pressure must put")
	}
	g.OnNoSpace("a", now)
	for i := range DefaultProbeEvery {
		if a := g.Admit("a", now); a != AdmitSkip {
			t.Fatalf("skip %d: %s", i, a)
		}
		if a := g.Admit("b", now); a != AdmitPut {
			t.Fatalf("another request under a's pressure: %s, want put", a)
		}
	}
	if a := g.Admit("a", now); a != AdmitProbe {
		t.Fatalf("after %d skips: %s, want probe", DefaultProbeEvery, a)
	}
	if a := g.Admit("a", now.Add(DefaultPressureCoolDown)); a != AdmitProbe {
		t.Fatalf("after the default cool-down: %s, want probe", a)
	}
	if g.UnderPressure() != 1 || !g.Active() {
		t.Fatalf("gate %+v, want a under pressure", g)
	}
	b, err := json.Marshal(g)
	if err != nil {
		t.Fatal(err)
	}
	var back PressureGate
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back, g) {
		t.Fatalf("round trip: %v %+v", err, back)
	}
	c := g.Clone()
	g.OnPutOK()
	if g.Admit("a", now) != AdmitPut || g.Skipped != DefaultProbeEvery || g.Active() || g.UnderPressure() != 0 {
		t.Fatalf("gate %+v", g)
	}
	if c.UnderPressure() != 1 {
		t.Fatalf("clone shares the gate's scopes: %+v", c)
	}
}

func TestPressureGateBoundsScopes(t *testing.T) {
	g := PressureGate{MaxScopes: 2, CoolDown: time.Hour}
	now := time.Unix(100, 0)
	g.OnNoSpace("a", now)
	g.OnNoSpace("b", now.Add(time.Second))
	g.OnNoSpace("a", now.Add(2*time.Second)) // a again: its cool-down restarts, b waits longest
	g.OnNoSpace("c", now.Add(3*time.Second))
	got := map[string]Admission{}
	for _, k := range []string{"a", "b", "c"} {
		got[k] = g.Admit(k, now.Add(4*time.Second))
	}
	want := map[string]Admission{"a": AdmitSkip, "b": AdmitPut, "c": AdmitSkip}
	if !reflect.DeepEqual(got, want) || g.Released != 1 || g.Episodes != 1 || g.UnderPressure() != 2 {
		t.Fatalf("admissions %v released %d episodes %d scopes %d; want %v, 1, 1, 2", got, g.Released, g.Episodes, g.UnderPressure(), want)
	}
}

func TestPressureScopeOf(t *testing.T) {
	cases := []struct {
		name string
		a, b kvcore.SaveTask
		same bool
	}{
		{"same request and epoch, other task", kvcore.SaveTask{TaskID: "1", EngineID: "e", RequestID: "r"}, kvcore.SaveTask{TaskID: "2", EngineID: "e", RequestID: "r"}, true},
		{"other engine", kvcore.SaveTask{EngineID: "e1", RequestID: "r"}, kvcore.SaveTask{EngineID: "e2", RequestID: "r"}, false},
		{"other epoch", kvcore.SaveTask{EngineID: "e", RequestID: "r"}, kvcore.SaveTask{EngineID: "e", RequestID: "r", Epoch: 1}, false},
		{"ids that run together", kvcore.SaveTask{EngineID: "e r", RequestID: "x"}, kvcore.SaveTask{EngineID: "e", RequestID: "r x"}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := PressureScopeOf(&c.a) == PressureScopeOf(&c.b); got != c.same {
				t.Fatalf("%q vs %q: same %v, want %v", PressureScopeOf(&c.a), PressureScopeOf(&c.b), got, c.same)
			}
		})
	}
}

func TestRetryBackoff(t *testing.T) {
	cases := []struct {
		name string
		p    RetryPolicy
		n    int
		want time.Duration
	}{
		{"defaults first", RetryPolicy{}, 1, DefaultRetryBase},
		{"defaults third", RetryPolicy{}, 3, 4 * DefaultRetryBase},
		{"capped", RetryPolicy{}, 30, DefaultRetryMax},
		{"zero counts as one", RetryPolicy{BaseDelay: time.Second, MaxDelay: time.Minute}, 0, time.Second},
		{"huge attempt count", RetryPolicy{BaseDelay: 1, MaxDelay: math.MaxInt64}, math.MaxInt, math.MaxInt64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := c.p.Policy().Delay(c.n); got != c.want {
				t.Fatalf("backoff(%d) = %v, want %v", c.n, got, c.want)
			}
		})
	}
	if d := (RetryPolicy{}).ExistsFailed(DefaultRetryAttempts - 1); d.Action != RetryAgain {
		t.Fatalf("default attempts: %+v", d)
	}
	if d := (RetryPolicy{}).ExistsFailed(DefaultRetryAttempts); d.Action != RetryDeadLetter || d.Reason != kvcore.ReasonExistsFailed {
		t.Fatalf("default give-up: %+v", d)
	}
}

// TestS17ExistsRetriedThenDeadLettered (S17, the policy's part): a failing
// existence check is retried with backoff, then dead-lettered; a failing put
// is given up as failed (the sending package's tests count the outcome).
func TestS17ExistsRetriedThenDeadLettered(t *testing.T) {
	p := RetryPolicy{MaxAttempts: 3, BaseDelay: 10 * time.Millisecond, MaxDelay: time.Second}
	want := []RetryDecision{
		{Action: RetryAgain, Delay: 10 * time.Millisecond},
		{Action: RetryAgain, Delay: 20 * time.Millisecond},
		{Action: RetryDeadLetter, Reason: kvcore.ReasonExistsFailed},
	}
	for i, w := range want {
		if got := p.ExistsFailed(i + 1); got != w {
			t.Fatalf("after %d failures: %+v, want %+v", i+1, got, w)
		}
	}
	if got := p.PutFailed(3); got.Action != RetryFail || got.Reason != kvcore.ReasonPutFailed {
		t.Fatalf("put give-up %+v", got)
	}
	if p.Attempts() != 3 || (RetryPolicy{}).Attempts() != DefaultRetryAttempts {
		t.Fatalf("attempts %d and %d, want 3 and %d", p.Attempts(), RetryPolicy{}.Attempts(), DefaultRetryAttempts)
	}
}

// TestS18NoSpacePressureUntilPutSucceeds (S18): puts of request a answer "no space" twice → a's later saves
// are skipped (counted) until a put succeeds, probes going through; request
// b's saves are put meanwhile (issue 14: pressure is scoped to the request
// that hit it, as vLLM's _skip_store_requests; before, every request was
// skipped); a put of b that succeeds lets a go.
func TestS18NoSpacePressureUntilPutSucceeds(t *testing.T) {
	g := PressureGate{ProbeEvery: 3, CoolDown: time.Hour}
	now := time.Unix(1000, 0)
	// answers the store gives to a's puts that go through, in order.
	answers := []bool{false, false, true} // no space, no space, ok
	var got []Admission
	for range 10 {
		a := g.Admit("a", now)
		got = append(got, a)
		if b := g.Admit("b", now); b != AdmitPut {
			t.Fatalf("request b admitted %s while a is under pressure, want put", b)
		}
		if a == AdmitSkip || len(answers) == 0 {
			continue
		}
		ok := answers[0]
		answers = answers[1:]
		if ok {
			g.OnPutOK()
		} else {
			g.OnNoSpace("a", now)
		}
	}
	want := []Admission{AdmitPut, AdmitSkip, AdmitSkip, AdmitSkip, AdmitProbe, AdmitSkip, AdmitSkip, AdmitSkip, AdmitProbe, AdmitPut}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("admissions %v, want %v", got, want)
	}
	if g.Skipped != 6 || g.Active() || g.Episodes != 1 {
		t.Fatalf("gate %+v, want 6 skipped, inactive, 1 episode", g)
	}
	// The cool-down alone also lets a probe through.
	g.OnNoSpace("a", now)
	if a := g.Admit("a", now.Add(time.Minute)); a != AdmitSkip {
		t.Fatalf("before cool-down: %s", a)
	}
	if a := g.Admit("a", now.Add(time.Hour)); a != AdmitProbe {
		t.Fatalf("after cool-down: %s", a)
	}
	// Another request's successful put ends a's pressure.
	g.OnNoSpace("a", now)
	g.OnPutOK()
	if a := g.Admit("a", now); a != AdmitPut || g.Episodes != 2 {
		t.Fatalf("after b's put: %s, episodes %d; want put, 2", a, g.Episodes)
	}
}

// formerBackoff is RetryPolicy.Backoff as the sender computed it before
// pkg/retry did: the reference TestBackoffKeepsItsDelays holds it to.
func formerBackoff(p RetryPolicy, n int) time.Duration {
	base, ceil := p.BaseDelay, p.MaxDelay
	if base <= 0 {
		base = DefaultRetryBase
	}
	if ceil <= 0 {
		ceil = DefaultRetryMax
	}
	d := base
	for i := 1; i < n && d < ceil; i++ {
		if d > ceil/2 {
			return ceil
		}
		d *= 2
	}
	return min(d, ceil)
}

func TestBackoffKeepsItsDelays(t *testing.T) {
	policies := []RetryPolicy{
		{}, {BaseDelay: time.Millisecond, MaxDelay: 2 * time.Millisecond},
		{BaseDelay: 10 * time.Millisecond, MaxDelay: time.Second}, {BaseDelay: 3 * time.Millisecond, MaxDelay: 7 * time.Millisecond},
		{BaseDelay: time.Second, MaxDelay: 100 * time.Millisecond}, {BaseDelay: 1, MaxDelay: math.MaxInt64},
		{BaseDelay: 7, MaxDelay: 1000}, {BaseDelay: -1, MaxDelay: -1},
	}
	for _, p := range policies {
		for _, n := range []int{-1, 0, 1, 2, 3, 4, 5, 8, 20, 62, 63, 64, 65, 1000, math.MaxInt} {
			if got, want := p.Policy().Delay(n), formerBackoff(p, n); got != want {
				t.Errorf("%+v.Policy().Delay(%d) = %v, want %v", p, n, got, want)
			}
		}
	}
}
