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
	if g.Admit(now) != AdmitPut {
		t.Fatal("no pressure must put")
	}
	g.OnNoSpace(now)
	for i := range DefaultProbeEvery {
		if a := g.Admit(now); a != AdmitSkip {
			t.Fatalf("skip %d: %s", i, a)
		}
	}
	if a := g.Admit(now); a != AdmitProbe {
		t.Fatalf("after %d skips: %s, want probe", DefaultProbeEvery, a)
	}
	if a := g.Admit(now.Add(DefaultPressureCoolDown)); a != AdmitProbe {
		t.Fatalf("after the default cool-down: %s, want probe", a)
	}
	g.OnPutOK()
	if g.Admit(now) != AdmitPut || g.Skipped != DefaultProbeEvery {
		t.Fatalf("gate %+v", g)
	}
	b, err := json.Marshal(g)
	if err != nil {
		t.Fatal(err)
	}
	var back PressureGate
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back, g) {
		t.Fatalf("round trip: %v %+v", err, back)
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
