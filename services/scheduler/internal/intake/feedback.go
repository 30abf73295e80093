package intake

import (
	"encoding/json"
	"maps"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// maxFeedbackBytes bounds the feedback values one batch record joins (a
// finished_recving lists its load errors, which can be long); a message
// larger than it goes in a batch of its own.
const maxFeedbackBytes = 256 << 10

// FoldFeedback joins the feedback messages of one transaction's messages
// (in the order the transaction produced them) into one
// contract.EngineFeedbackBatch per engine, at the place of the engine's
// first one; the other messages keep their places. An engine's messages
// keep their order, within a batch and across the batches a long run
// splits into (contract.MaxFeedbackBatch, maxFeedbackBytes). A batch
// carries the headers — the trace context — of its first message.
func FoldFeedback(msgs []bus.Message) []bus.Message {
	groups := map[string][]bus.Message{}
	n := 0
	for _, m := range msgs {
		if m.Topic == contract.TopicEngineFeedback {
			groups[m.Key] = append(groups[m.Key], m)
			n++
		}
	}
	if n == 0 {
		return msgs
	}
	out := make([]bus.Message, 0, len(msgs)-n+len(groups))
	for _, m := range msgs {
		if m.Topic != contract.TopicEngineFeedback {
			out = append(out, m)
			continue
		}
		if g, ok := groups[m.Key]; ok {
			out = append(out, feedbackBatches(m.Key, g)...)
			delete(groups, m.Key)
		}
	}
	return out
}

// feedbackBatches joins one engine's feedback messages into batch records.
func feedbackBatches(engineID string, msgs []bus.Message) []bus.Message {
	var out []bus.Message
	for len(msgs) > 0 {
		n, size := 1, len(msgs[0].Value)
		for n < len(msgs) && n < contract.MaxFeedbackBatch && size+len(msgs[n].Value) <= maxFeedbackBytes {
			size += len(msgs[n].Value)
			n++
		}
		out = append(out, feedbackBatch(engineID, msgs[:n]))
		msgs = msgs[n:]
	}
	return out
}

// feedbackBatch is the contract.EngineFeedbackBatch record of msgs, whose
// values are EngineFeedback encodings: joined as they are, not decoded.
func feedbackBatch(engineID string, msgs []bus.Message) bus.Message {
	id, _ := json.Marshal(engineID) // a string always marshals
	size := 64 + len(id)
	for _, m := range msgs {
		size += len(m.Value) + 1
	}
	v := make([]byte, 0, size)
	v = append(v, `{"schema":"`+contract.SchemaEngineFeedbackBatch+`","engine_id":`...)
	v = append(v, id...)
	v = append(v, `,"feedback":[`...)
	for i, m := range msgs {
		if i > 0 {
			v = append(v, ',')
		}
		v = append(v, m.Value...)
	}
	v = append(v, "]}"...)
	return bus.Message{Topic: contract.TopicEngineFeedback, Key: engineID, Value: v, Headers: maps.Clone(msgs[0].Headers)}
}
