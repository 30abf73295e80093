package sim

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"testing"
	"time"
)

// simRequests builds the requests the simulator itself plays for cfg's
// workload, turn by turn, the way submitTurn and newRequest build them.
func simRequests(t *testing.T, cfg Config) []*request {
	t.Helper()
	convs, err := Generate(cfg.Workload)
	if err != nil {
		t.Fatal(err)
	}
	r := &run{cfg: cfg, convs: convs}
	e := &engine{id: "decode-0", role: RoleBoth}
	var out []*request
	for _, c := range r.convs {
		for i := range c.Turns {
			ts := &turnState{ctx: context.Background(), conv: c, index: i, id: r.turnID(c, i)}
			req := r.newRequest(ts, e, len(c.Turns[i].Output))
			req.span.End()
			out = append(out, req)
		}
	}
	return out
}

// TestPlanWorkloadIsWhatTheSimPlays: for several workloads, every planned
// request has the id, tenant, prompt and reply of the simulator's own
// request, in the same order, and waits for the conversation's previous
// turn.
func TestPlanWorkloadIsWhatTheSimPlays(t *testing.T) {
	tenants := testWorkload()
	tenants.Tenants, tenants.TenantPrefix = 3, "t"
	burst := testWorkload()
	burst.Rate, burst.Seed = 0, 99
	think := testWorkload()
	think.ThinkTime = 20 * time.Millisecond
	for name, w := range map[string]Workload{"default": testWorkload(), "tenants": tenants, "burst": burst, "think": think} {
		t.Run(name, func(t *testing.T) {
			const tag = "plan-abc123"
			plan, err := PlanWorkload(w, tag)
			if err != nil {
				t.Fatal(err)
			}
			want := simRequests(t, Config{Workload: w, RunTag: tag, Salt: "salt"})
			if len(plan.Requests) != len(want) || len(want) != w.Requests {
				t.Fatalf("%d planned requests, the sim plays %d, the workload has %d", len(plan.Requests), len(want), w.Requests)
			}
			convs, _ := Generate(w)
			for i, p := range plan.Requests {
				s := want[i]
				if p.RequestID != s.id || p.Tenant != s.tenant ||
					!slices.Equal(p.PromptTokenIDs, tokenIDs(s.prompt)) || !slices.Equal(p.OutputTokenIDs, tokenIDs(s.output)) {
					t.Fatalf("request %d: plan %s (tenant %q, %d prompt, %d output tokens), sim %s (tenant %q, %d, %d)",
						i, p.RequestID, p.Tenant, len(p.PromptTokenIDs), len(p.OutputTokenIDs), s.id, s.tenant, len(s.prompt), len(s.output))
				}
				checkOrder(t, p, tag, convs[p.Conversation], w.ThinkTime)
			}
			if plan.RunTag != tag || plan.Salt != "" || plan.HashBlockSize != 0 {
				t.Fatalf("plan header %+v", plan)
			}
		})
	}
}

// checkOrder: a first turn arrives at its conversation's start, a later one
// waits for the previous turn and the think time.
func checkOrder(t *testing.T, p PlannedRequest, tag string, c *Conversation, think time.Duration) {
	t.Helper()
	if p.Turn == 0 {
		if p.After != "" || p.ThinkTimeMs != 0 || p.StartMs != millis(c.Start) {
			t.Fatalf("first turn %s: after %q, think %v ms, start %v ms; want none, 0, %v", p.RequestID, p.After, p.ThinkTimeMs, p.StartMs, millis(c.Start))
		}
		return
	}
	if p.After != RequestID(tag, p.Conversation, p.Turn-1) || p.ThinkTimeMs != millis(think) || p.StartMs != 0 {
		t.Fatalf("turn %s: after %q, think %v ms, start %v ms", p.RequestID, p.After, p.ThinkTimeMs, p.StartMs)
	}
}

// TestPlanWorkloadJSON: the plan round-trips through JSON with the field
// names the Python harness reads.
func TestPlanWorkloadJSON(t *testing.T) {
	plan, err := PlanWorkload(testWorkload(), "plan-json")
	if err != nil {
		t.Fatal(err)
	}
	plan.Salt, plan.HashBlockSize = "plan-json", 16
	b, err := json.Marshal(plan)
	if err != nil {
		t.Fatal(err)
	}
	var back WorkloadPlan
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, plan) {
		t.Fatal("the plan does not round-trip through JSON")
	}
	var raw struct {
		Requests []map[string]json.RawMessage `json:"requests"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	for _, field := range []string{"request_id", "conversation", "turn", "after", "tenant", "prompt_token_ids", "output_token_ids"} {
		if _, ok := raw.Requests[0][field]; !ok {
			t.Fatalf("request JSON lacks %q: %s", field, b[:min(len(b), 300)])
		}
	}
}

// TestPlanWorkloadErrors: a bad workload or an empty run tag is refused.
func TestPlanWorkloadErrors(t *testing.T) {
	bad := testWorkload()
	bad.Requests = 0
	for _, tc := range []struct {
		name string
		w    Workload
		tag  string
		want error
	}{
		{"bad workload", bad, "tag", ErrWorkload},
		{"empty tag", testWorkload(), "", ErrConfig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := PlanWorkload(tc.w, tc.tag); !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
		})
	}
}

// TestRequestID is the id format the e2e tests parse.
func TestRequestID(t *testing.T) {
	if got := RequestID("sim-0a1b2c", 7, 3); got != "sim-0a1b2c-c0007-t03" {
		t.Fatalf("RequestID = %q", got)
	}
}
