package intake

import (
	"errors"
	"fmt"
	"strings"

	"github.com/segmentio/encoding/json"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// errInvalid wraps every validation failure.
var errInvalid = errors.New("invalid record")

// item is one decoded record: its ledger identity and the requests it
// changes.
type item struct {
	// topic is the topic the record was consumed from.
	topic  string
	record ledger.Record
	// label names the record in spans and logs ("step e1/7", "decision d1").
	label   string
	changes []change
}

// change is one request's part of an item.
type change struct {
	requestID string
	create    bool
	// label names the change ("event 3 scheduled").
	label string
	// traceparent is the request's trace context, when the producer gave
	// it: a step event's own, the headers' of a decision or a result.
	traceparent string
	// event is what the change applies to its request
	// (requeststate.Request.Apply).
	event requeststate.Event
}

// rules are what intake checks and keeps of engine events beyond their
// shape: the served models, whose hash block size an admitted event's
// token ids are checked against, and whether the token ids are kept at
// all.
type rules struct {
	models *kvcore.Models
	// dropTokenIDs drops every admitted event's token ids, after they
	// were checked (KVMESH_KV_EVENTS_TOKEN_IDS=false); the LoRA name is
	// kept.
	dropTokenIDs bool
}

// decode turns a consumed record into an item, or a permanent error. The
// change of a record about one request (a decision, a result) takes the
// trace context of the record's headers: its producer (the lookup, a
// gpuworker, the sender) publishes it inside the request's trace. A step
// record's headers are the engine step's, shared by its requests; its
// events carry their own.
func decode(rec bus.Received, rl rules) (item, error) {
	var it item
	var err error
	switch rec.Topic {
	case contract.TopicEngineSteps:
		it, err = decodeStep(rec.Value, rl)
		it.topic = rec.Topic
		return it, err
	case contract.TopicLookupDecisions:
		it, err = decodeDecision(rec.Value)
	case contract.TopicTransferResults:
		it, err = decodeResult(rec.Value)
	default:
		return item{}, bus.Permanent(kvcore.ReasonUnknownTopic, fmt.Errorf("topic %q", rec.Topic))
	}
	if err == nil {
		it.topic = rec.Topic
		it.changes[0].traceparent = rec.Headers[contract.HeaderTraceparent]
	}
	return it, err
}

// unmarshal decodes a JSON value, classifying failures as undecodable.
func unmarshal(b []byte, v any) error {
	if err := json.Unmarshal(b, v); err != nil {
		return bus.Permanent(kvcore.ReasonUndecodable, err)
	}
	return nil
}

// invalid returns a permanent invalid-record error.
func invalid(format string, args ...any) error {
	return bus.Permanent(kvcore.ReasonInvalidRecord, fmt.Errorf("%w: "+format, append([]any{errInvalid}, args...)...))
}

// requireIDs checks the schema and the identifying fields of a record.
func requireIDs(schema, want string, ids map[string]string) error {
	if schema != want {
		return invalid("schema %q, want %q", schema, want)
	}
	for _, name := range []string{"step_id", "decision_id", "result_id", "task_id", "engine_id", "request_id"} {
		if v, ok := ids[name]; ok && v == "" {
			return invalid("%s is empty", name)
		}
	}
	return nil
}

// validIDs checks identifiers for what PostgreSQL text can hold: a NUL
// byte would fail the whole transaction of a batch, every time.
func validIDs(ids ...string) error {
	for _, id := range ids {
		if strings.IndexByte(id, 0) >= 0 {
			return invalid("identifier %q contains a NUL byte", id)
		}
	}
	return nil
}

func decodeStep(b []byte, rl rules) (item, error) {
	var st contract.EngineStep
	if err := unmarshal(b, &st); err != nil {
		return item{}, err
	}
	err := requireIDs(st.Schema, contract.SchemaEngineStep, map[string]string{"step_id": st.StepID, "engine_id": st.EngineID})
	switch {
	case err != nil:
		return item{}, err
	case len(st.Requests) > contract.MaxStepRequests:
		return item{}, invalid("step %s: %d request events, at most %d", st.StepID, len(st.Requests), contract.MaxStepRequests)
	}
	if err := validIDs(st.StepID, st.EngineID, st.Model); err != nil {
		return item{}, err
	}
	if st.NullBlockID != nil && *st.NullBlockID < 0 {
		return item{}, invalid("step %s: null_block_id %d is negative (leave it out when null blocks are JSON null)", st.StepID, *st.NullBlockID)
	}
	null := kvcore.EngineNullBlock(st.NullBlockID)
	m, err := rl.models.Get(st.Model)
	if err != nil {
		m = rl.models.Default() // the state machine fails the step's requests: not served
	}
	it := item{
		record:  ledger.Record{Kind: ledger.KindStep, ID: st.StepID, EngineID: st.EngineID},
		label:   "step " + st.StepID,
		changes: make([]change, 0, len(st.Requests)),
	}
	for i := range st.Requests {
		ev := st.Requests[i]
		if err := checkEvent(st.StepID, i, ev, m.HashBlockSize); err != nil {
			return item{}, err
		}
		normalizeNull(&ev, null)
		if rl.dropTokenIDs {
			ev.TokenIDs = nil
		}
		it.changes = append(it.changes, change{
			requestID: ev.RequestID, create: true, label: fmt.Sprintf("event %d %s", ev.Seq, ev.Kind),
			traceparent: ev.Traceparent,
			event:       requeststate.EngineEvent{Model: st.Model, Event: ev},
		})
	}
	return it, nil
}

// normalizeNull turns the engine's null block id into kvcore.NullBlock in
// the event's block tables (allocated's BlockTable, scheduled's
// Step.Table), once, at the edge: past intake every table knows one null.
// The step is copied, never changed in place.
func normalizeNull(ev *contract.RequestEvent, null kvcore.BlockID) {
	if null == kvcore.NullBlock {
		return
	}
	ev.BlockTable = ev.BlockTable.NormalizeNull(null)
	if ev.Step != nil {
		step := *ev.Step
		step.Table = step.Table.NormalizeNull(null)
		ev.Step = &step
	}
}

// checkEvent validates one request event of a step. An invalid event
// dead-letters its whole step record: the engine that produced it is
// broken, and the requests of the step fail closed at their next event
// (a seq gap).
func checkEvent(stepID string, i int, ev contract.RequestEvent, hashBlockSize int) error {
	switch {
	case ev.RequestID == "":
		return invalid("step %s: request event %d: request_id is empty", stepID, i)
	case ev.Seq < 1:
		return invalid("step %s: request %s: seq %d is not positive", stepID, ev.RequestID, ev.Seq)
	case ev.ExternalTokens < 0:
		return invalid("step %s: request %s: external_tokens %d is negative", stepID, ev.RequestID, ev.ExternalTokens)
	case ev.Kind == contract.EventScheduled && ev.Step == nil:
		return invalid("step %s: request %s: scheduled without a step", stepID, ev.RequestID)
	}
	switch ev.Kind {
	case contract.EventAdmitted, contract.EventAllocated, contract.EventScheduled, contract.EventPreempted, contract.EventFinished:
	default:
		return invalid("step %s: request %s: kind %q", stepID, ev.RequestID, ev.Kind)
	}
	if err := hexChain(stepID, ev.RequestID, ev.BlockHashes); err != nil {
		return err
	}
	if err := tokenList(stepID, ev, hashBlockSize); err != nil {
		return err
	}
	if ev.Step != nil {
		if err := hexChain(stepID, ev.RequestID, ev.Step.Hashes); err != nil {
			return err
		}
	}
	return validIDs(ev.RequestID, ev.DecisionID, ev.Tenant, ev.LoraName)
}

// hexChain refuses a hash chain with an element that is not lower-case
// hex: such a hash could never name a store key, and the ledger stores
// chains as comma-joined text.
func hexChain(stepID, requestID string, hashes []string) error {
	for i, h := range hashes {
		if !kvcore.IsHashHex(h) {
			return invalid("step %s: request %s: block hash %d %q is not lower-case hex", stepID, requestID, i, h)
		}
	}
	return nil
}

// tokenList refuses an event's token ids unless they are the tokens of
// complete hash blocks of an admitted event: a multiple of the hash block
// size, covered by the event's own hash chain and its prompt. Like a bad
// chain, such a list means a broken producer: the step is dead-lettered
// before the token ids could key a wrong block in a router's index.
func tokenList(stepID string, ev contract.RequestEvent, hashBlockSize int) error {
	n := len(ev.TokenIDs)
	switch {
	case n == 0:
		return nil
	case ev.Kind != contract.EventAdmitted:
		return invalid("step %s: request %s: token_ids on a %s event (only admitted carries them)", stepID, ev.RequestID, ev.Kind)
	case n > ev.PromptTokens:
		return invalid("step %s: request %s: %d token ids, the prompt has %d tokens", stepID, ev.RequestID, n, ev.PromptTokens)
	}
	if err := kvcore.CheckTokenIDs(hashBlockSize, n, len(ev.BlockHashes)); err != nil {
		return invalid("step %s: request %s: %w", stepID, ev.RequestID, err)
	}
	return nil
}

func decodeDecision(b []byte) (item, error) {
	var d contract.LookupDecision
	if err := unmarshal(b, &d); err != nil {
		return item{}, err
	}
	err := requireIDs(d.Schema, contract.SchemaLookupDecision,
		map[string]string{"decision_id": d.DecisionID, "engine_id": d.EngineID, "request_id": d.RequestID})
	if err == nil {
		err = validIDs(d.DecisionID, d.EngineID, d.RequestID, d.Tenant)
	}
	if err != nil {
		return item{}, err
	}
	return single(ledger.Record{Kind: ledger.KindDecision, ID: d.DecisionID, EngineID: d.EngineID, RequestID: d.RequestID, Create: true},
		"decision "+d.DecisionID, requeststate.DecisionEvent{Decision: d}), nil
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
	if err := validIDs(res.ResultID, res.TaskID, res.EngineID, res.RequestID); err != nil {
		return item{}, err
	}
	return single(ledger.Record{Kind: ledger.KindResult, ID: res.ResultID, EngineID: res.EngineID, RequestID: res.RequestID},
		fmt.Sprintf("%s result %s", res.Kind, res.ResultID), requeststate.ResultEvent{Result: res}), nil
}

// single is the item of a record changing its own request.
func single(rec ledger.Record, label string, ev requeststate.Event) item {
	return item{record: rec, label: label, changes: []change{{requestID: rec.RequestID, create: rec.Create, label: label, event: ev}}}
}
