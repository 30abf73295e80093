package intake

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/tracking"
)

// Dead-letter reason codes of the scheduler, beside bus.ReasonUndecodable.
const (
	// ReasonInvalidRecord marks a record that decodes but misses a required
	// field or carries an impossible value.
	ReasonInvalidRecord = "invalid_record"
	// ReasonUnknownTopic marks a record from a topic the scheduler does not
	// consume.
	ReasonUnknownTopic = "unknown_topic"
)

// errInvalid wraps every validation failure.
var errInvalid = errors.New("invalid record")

// item is one decoded record: its ledger identity and how it changes the
// request.
type item struct {
	record ledger.Record
	// label names the record in spans ("event 3 scheduled", "decision d1").
	label string
	apply func(m *kvcore.Model, req *tracking.Request) tracking.Outcome
}

// decode turns a consumed record into an item, or a permanent error.
func decode(rec bus.Received) (item, error) {
	switch rec.Topic {
	case contract.TopicEngineEvents:
		return decodeEvent(rec.Value)
	case contract.TopicLookupDecisions:
		return decodeDecision(rec.Value)
	case contract.TopicTransferResults:
		return decodeResult(rec.Value)
	}
	return item{}, bus.Permanent(ReasonUnknownTopic, fmt.Errorf("topic %q", rec.Topic))
}

// unmarshal decodes a JSON value, classifying failures as undecodable.
func unmarshal(b []byte, v any) error {
	if err := json.Unmarshal(b, v); err != nil {
		return bus.Permanent(bus.ReasonUndecodable, err)
	}
	return nil
}

// invalid returns a permanent invalid-record error.
func invalid(format string, args ...any) error {
	return bus.Permanent(ReasonInvalidRecord, fmt.Errorf("%w: "+format, append([]any{errInvalid}, args...)...))
}

// requireIDs checks the schema and the identifying fields of a record.
func requireIDs(schema, want string, ids map[string]string) error {
	if schema != want {
		return invalid("schema %q, want %q", schema, want)
	}
	for _, name := range []string{"event_id", "decision_id", "result_id", "task_id", "engine_id", "request_id"} {
		if v, ok := ids[name]; ok && v == "" {
			return invalid("%s is empty", name)
		}
	}
	return nil
}

func decodeEvent(b []byte) (item, error) {
	var ev contract.EngineEvent
	if err := unmarshal(b, &ev); err != nil {
		return item{}, err
	}
	err := requireIDs(ev.Schema, contract.SchemaEngineEvent,
		map[string]string{"event_id": ev.EventID, "engine_id": ev.EngineID, "request_id": ev.RequestID})
	switch {
	case err != nil:
		return item{}, err
	case ev.Seq < 1:
		return item{}, invalid("event %s: seq %d is not positive", ev.EventID, ev.Seq)
	case ev.ExternalTokens < 0:
		return item{}, invalid("event %s: external_tokens %d is negative", ev.EventID, ev.ExternalTokens)
	case ev.Kind == contract.EventScheduled && ev.Step == nil:
		return item{}, invalid("event %s: scheduled without a step", ev.EventID)
	}
	switch ev.Kind {
	case contract.EventAdmitted, contract.EventAllocated, contract.EventScheduled, contract.EventPreempted, contract.EventFinished:
	default:
		return item{}, invalid("event %s: kind %q", ev.EventID, ev.Kind)
	}
	return item{
		record: ledger.Record{Kind: ledger.KindEvent, ID: ev.EventID, EngineID: ev.EngineID, RequestID: ev.RequestID, Create: true},
		label:  fmt.Sprintf("event %d %s", ev.Seq, ev.Kind),
		apply: func(m *kvcore.Model, req *tracking.Request) tracking.Outcome {
			return req.Engine(m, ev)
		},
	}, nil
}

func decodeDecision(b []byte) (item, error) {
	var d contract.LookupDecision
	if err := unmarshal(b, &d); err != nil {
		return item{}, err
	}
	err := requireIDs(d.Schema, contract.SchemaLookupDecision,
		map[string]string{"decision_id": d.DecisionID, "engine_id": d.EngineID, "request_id": d.RequestID})
	if err != nil {
		return item{}, err
	}
	return item{
		record: ledger.Record{Kind: ledger.KindDecision, ID: d.DecisionID, EngineID: d.EngineID, RequestID: d.RequestID, Create: true},
		label:  "decision " + d.DecisionID,
		apply: func(m *kvcore.Model, req *tracking.Request) tracking.Outcome {
			return req.Decision(m, d)
		},
	}, nil
}

func decodeResult(b []byte) (item, error) {
	var res contract.TransferResult
	if err := unmarshal(b, &res); err != nil {
		return item{}, err
	}
	err := requireIDs(res.Schema, contract.SchemaTransferResult, map[string]string{
		"result_id": res.ResultID, "task_id": res.TaskID, "engine_id": res.EngineID, "request_id": res.RequestID})
	if err != nil {
		return item{}, err
	}
	if res.Kind != contract.TransferSave && res.Kind != contract.TransferLoad {
		return item{}, invalid("result %s: kind %q", res.ResultID, res.Kind)
	}
	return item{
		record: ledger.Record{Kind: ledger.KindResult, ID: res.ResultID, EngineID: res.EngineID, RequestID: res.RequestID},
		label:  fmt.Sprintf("%s result %s", res.Kind, res.ResultID),
		apply: func(m *kvcore.Model, req *tracking.Request) tracking.Outcome {
			return req.Result(m, res)
		},
	}, nil
}
