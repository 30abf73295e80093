package kvcore

import (
	"encoding/json"
	"math"
	"reflect"
	"testing"
	"time"
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
		a, b SaveTask
		same bool
	}{
		{"same request and epoch, other task", SaveTask{TaskID: "1", EngineID: "e", RequestID: "r"}, SaveTask{TaskID: "2", EngineID: "e", RequestID: "r"}, true},
		{"other engine", SaveTask{EngineID: "e1", RequestID: "r"}, SaveTask{EngineID: "e2", RequestID: "r"}, false},
		{"other epoch", SaveTask{EngineID: "e", RequestID: "r"}, SaveTask{EngineID: "e", RequestID: "r", Epoch: 1}, false},
		{"ids that run together", SaveTask{EngineID: "e r", RequestID: "x"}, SaveTask{EngineID: "e", RequestID: "r x"}, false},
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
			if got := c.p.Backoff(c.n); got != c.want {
				t.Fatalf("backoff(%d) = %v, want %v", c.n, got, c.want)
			}
		})
	}
	if d := (RetryPolicy{}).ExistsFailed(DefaultRetryAttempts - 1); d.Action != RetryAgain {
		t.Fatalf("default attempts: %+v", d)
	}
	if d := (RetryPolicy{}).ExistsFailed(DefaultRetryAttempts); d.Action != RetryDeadLetter || d.Reason != ReasonExistsFailed {
		t.Fatalf("default give-up: %+v", d)
	}
}

func TestSendOutcome(t *testing.T) {
	task := &SaveTask{TaskID: "t", EngineID: "e", RequestID: "r"}
	cases := []struct {
		name   string
		record func(o *SendOutcome)
		want   SaveStatus
	}{
		{"nothing to do is stored", func(*SendOutcome) {}, SaveStored},
		{"stored and existed", func(o *SendOutcome) {
			o.Record(0, OutcomeStored, 2, ReasonOK)
			o.Record(0, OutcomeExisted, 1, ReasonOK)
		}, SaveStored},
		{"skipped", func(o *SendOutcome) { o.Record(1, OutcomeSkipped, 3, ReasonStorePressure) }, SaveSkipped},
		{"dead letter beats skip", func(o *SendOutcome) {
			o.Record(0, OutcomeSkipped, 3, ReasonStorePressure)
			o.Record(1, OutcomeDeadLettered, 0, ReasonNullBlock)
		}, SaveDeadLettered},
		{"failure beats all", func(o *SendOutcome) {
			o.Record(1, OutcomeDeadLettered, 2, ReasonNullBlock)
			o.Record(0, OutcomeFailed, 0, ReasonPutFailed)
		}, SaveFailed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := NewSendOutcome(task)
			c.record(&o)
			if got := o.Status(); got != c.want {
				t.Fatalf("status %s, want %s (%+v)", got, c.want, o)
			}
		})
	}
	o := NewSendOutcome(task)
	o.Record(5, OutcomeStored, 1, ReasonOK)
	o.Record(1, OutcomeFailed, -3, ReasonPutFailed)
	o.Record(3, OutcomeExisted, 2, ReasonOK)
	o.Record(1, OutcomeFailed, 2, ReasonExistsFailed)
	want := []GroupOutcome{
		{Group: 1, Failed: 3, Reason: ReasonPutFailed},
		{Group: 3, Existed: 2},
		{Group: 5, Stored: 1},
	}
	if !reflect.DeepEqual(o.Groups, want) {
		t.Fatalf("groups %+v, want %+v", o.Groups, want)
	}
	if tot := o.Totals(); tot != (GroupOutcome{Group: -1, Stored: 1, Existed: 2, Failed: 3, Reason: ReasonPutFailed}) {
		t.Fatalf("totals %+v", tot)
	}
}
