package intake

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/tracking"
)

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeClassifiesRecords(t *testing.T) {
	ev := contract.EngineEvent{Schema: contract.SchemaEngineEvent, EventID: "1", EngineID: "e", RequestID: "r", Seq: 1,
		Kind: contract.EventScheduled, Model: "m", Step: &kvcore.Step{Kind: kvcore.StepPendingLoad}}
	with := func(f func(*contract.EngineEvent)) []byte {
		c := ev
		f(&c)
		return mustJSON(t, c)
	}
	res := contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "x", Kind: contract.TransferSave,
		TaskID: "t", EngineID: "e", RequestID: "r", Status: "stored"}
	dec := contract.LookupDecision{Schema: contract.SchemaLookupDecision, DecisionID: "d", EngineID: "e", RequestID: "r"}
	cases := []struct {
		name   string
		topic  string
		value  []byte
		reason string // "" = valid
		kind   string
	}{
		{"event", contract.TopicEngineEvents, mustJSON(t, ev), "", ledger.KindEvent},
		{"decision", contract.TopicLookupDecisions, mustJSON(t, dec), "", ledger.KindDecision},
		{"result", contract.TopicTransferResults, mustJSON(t, res), "", ledger.KindResult},
		{"not json", contract.TopicEngineEvents, []byte("{"), bus.ReasonUndecodable, ""},
		{"wrong schema", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.Schema = "x" }), ReasonInvalidRecord, ""},
		{"no event id", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.EventID = "" }), ReasonInvalidRecord, ""},
		{"no request id", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.RequestID = "" }), ReasonInvalidRecord, ""},
		{"seq 0", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.Seq = 0 }), ReasonInvalidRecord, ""},
		{"negative external", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.ExternalTokens = -1 }), ReasonInvalidRecord, ""},
		{"scheduled without step", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.Step = nil }), ReasonInvalidRecord, ""},
		{"unknown kind", contract.TopicEngineEvents, with(func(e *contract.EngineEvent) { e.Kind = "exploded" }), ReasonInvalidRecord, ""},
		{"result without task", contract.TopicTransferResults, mustJSON(t, contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "x", Kind: "save", EngineID: "e", RequestID: "r"}), ReasonInvalidRecord, ""},
		{"result of unknown kind", contract.TopicTransferResults, mustJSON(t, func() contract.TransferResult { r := res; r.Kind = "copy"; return r }()), ReasonInvalidRecord, ""},
		{"decision without id", contract.TopicLookupDecisions, mustJSON(t, contract.LookupDecision{Schema: contract.SchemaLookupDecision, EngineID: "e", RequestID: "r"}), ReasonInvalidRecord, ""},
		{"other topic", "kvmesh.other", mustJSON(t, ev), ReasonUnknownTopic, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			it, err := decode(bus.Received{Message: bus.Message{Topic: c.topic, Value: c.value}})
			if c.reason == "" {
				if err != nil || it.record.Kind != c.kind || it.record.EngineID != "e" || it.record.RequestID != "r" {
					t.Fatalf("decode: %+v, %v", it.record, err)
				}
				return
			}
			var pe *bus.PermanentError
			if !errors.As(err, &pe) || pe.Reason != c.reason {
				t.Fatalf("error %v, want permanent %s", err, c.reason)
			}
		})
	}
}

func TestMessagesKeys(t *testing.T) {
	out := trackingOutcome()
	msgs, err := Messages(out)
	if err != nil || len(msgs) != 3 {
		t.Fatalf("%d messages, %v", len(msgs), err)
	}
	want := [][2]string{{contract.TopicSaveTasks, "r"}, {contract.TopicLoadTasks, "e"}, {contract.TopicEngineFeedback, "e"}}
	for i, w := range want {
		if msgs[i].Topic != w[0] || msgs[i].Key != w[1] {
			t.Fatalf("message %d to %s key %s, want %v", i, msgs[i].Topic, msgs[i].Key, w)
		}
	}
}

// trackingOutcome is an outcome with one save, one load and one feedback.
func trackingOutcome() tracking.Outcome {
	return tracking.Outcome{
		Saves:    []kvcore.SaveTask{{TaskID: "s", EngineID: "e", RequestID: "r"}},
		Loads:    []kvcore.LoadTask{{TaskID: "l", EngineID: "e", RequestID: "r"}},
		Feedback: []contract.EngineFeedback{{Feedback: kvcore.Feedback{Kind: kvcore.FeedbackFinishedSending, EngineID: "e", RequestID: "r"}}},
	}
}
