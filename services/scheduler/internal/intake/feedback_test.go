package intake

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// feedbackMsg is the message Messages makes of one feedback to engine for
// request, with a traceparent header naming the request.
func feedbackMsg(t *testing.T, engine, request string, loadErrors int) bus.Message {
	t.Helper()
	f := contract.EngineFeedback{Schema: contract.SchemaEngineFeedback,
		Feedback: kvcore.Feedback{Kind: kvcore.FeedbackFinishedRecving, EngineID: engine, RequestID: request}}
	for i := range loadErrors {
		f.LoadErrors = append(f.LoadErrors, kvcore.BlockID(i))
	}
	m, err := message(contract.TopicEngineFeedback, engine, f)
	if err != nil {
		t.Fatal(err)
	}
	m.Headers = map[string]string{"traceparent": "tp-" + request}
	return m
}

// summary names each message: topic initial, key, and for a feedback
// batch the request ids it carries, in order.
func summary(t *testing.T, msgs []bus.Message) []string {
	t.Helper()
	var out []string
	for _, m := range msgs {
		if m.Topic != contract.TopicEngineFeedback {
			out = append(out, m.Topic[7:8]+":"+m.Key)
			continue
		}
		var b contract.EngineFeedbackBatch
		if err := json.Unmarshal(m.Value, &b); err != nil || b.Schema != contract.SchemaEngineFeedbackBatch || b.EngineID != m.Key {
			t.Fatalf("feedback record %s: %v", m.Value, err)
		}
		ids := make([]string, len(b.Feedback))
		for i, f := range b.Feedback {
			if f.EngineID != m.Key {
				t.Fatalf("batch for %s holds feedback to %s", m.Key, f.EngineID)
			}
			ids[i] = f.RequestID
		}
		if got := m.Headers["traceparent"]; got != "tp-"+ids[0] {
			t.Fatalf("batch %v carries traceparent %q, want its first message's", ids, got)
		}
		out = append(out, "f:"+m.Key+"["+strings.Join(ids, ",")+"]")
	}
	return out
}

func TestFoldFeedback(t *testing.T) {
	save := func(r string) bus.Message {
		return bus.Message{Topic: contract.TopicSaveTasks, Key: r, Value: []byte(`{}`)}
	}
	load := func(e string) bus.Message {
		return bus.Message{Topic: contract.TopicLoadTasks, Key: e, Value: []byte(`{}`)}
	}
	fb := func(e, r string) bus.Message { return feedbackMsg(t, e, r, 0) }
	tests := []struct {
		name string
		in   []bus.Message
		want []string
	}{
		{"no feedback", []bus.Message{save("r1"), load("e1")}, []string{"s:r1", "l:e1"}},
		{"one feedback", []bus.Message{fb("e1", "r1")}, []string{"f:e1[r1]"}},
		{"one engine's feedback joined at its first place, in order",
			[]bus.Message{save("r1"), fb("e1", "r1"), load("e1"), fb("e1", "r3"), fb("e1", "r2")},
			[]string{"s:r1", "f:e1[r1,r3,r2]", "l:e1"}},
		{"one record per engine",
			[]bus.Message{fb("e2", "a"), fb("e1", "b"), save("r"), fb("e2", "c"), fb(`e"3`, "d")},
			[]string{"f:e2[a,c]", "f:e1[b]", "s:r", `f:e"3[d]`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := summary(t, FoldFeedback(tc.in))
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("folded to %v, want %v", got, tc.want)
			}
		})
	}
}

// TestFoldFeedbackSplits: a run longer than contract.MaxFeedbackBatch, or
// larger than maxFeedbackBytes, becomes several records, in order, each
// within both bounds; a message over the byte bound goes alone.
func TestFoldFeedbackSplits(t *testing.T) {
	var in []bus.Message
	for i := range contract.MaxFeedbackBatch + 3 {
		in = append(in, feedbackMsg(t, "e", fmt.Sprint(i), 0))
	}
	big := feedbackMsg(t, "e", "big", maxFeedbackBytes/4)
	in = append(in, feedbackMsg(t, "e", "before-big", 0), big, feedbackMsg(t, "e", "after-big", 0))
	out := FoldFeedback(in)
	var ids []string
	for i, m := range out {
		fs, err := contract.DecodeEngineFeedback(m.Value)
		if err != nil {
			t.Fatal(err)
		}
		if len(fs) > contract.MaxFeedbackBatch || (len(fs) > 1 && len(m.Value) > maxFeedbackBytes+4096) {
			t.Fatalf("record %d: %d messages, %d bytes", i, len(fs), len(m.Value))
		}
		for _, f := range fs {
			ids = append(ids, f.RequestID)
		}
	}
	// [0, 511], [512, 514] and before-big, big alone, after-big.
	if len(out) != 4 || len(ids) != len(in) {
		t.Fatalf("%d records of %d messages, want 4 of %d", len(out), len(ids), len(in))
	}
	if fs, _ := contract.DecodeEngineFeedback(out[2].Value); len(fs) != 1 || fs[0].RequestID != "big" {
		t.Fatalf("record 2 holds %d messages, want the big one alone", len(fs))
	}
	for i, m := range in {
		var f contract.EngineFeedback
		if err := json.Unmarshal(m.Value, &f); err != nil || f.RequestID != ids[i] {
			t.Fatalf("message %d is %s, want %s (%v)", i, ids[i], f.RequestID, err)
		}
	}
}
