package intake

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// testRules are the intake rules of a model with 16-token hash blocks
// (hybrid-mla-linear), keeping token ids.
var testRules = rules{models: hashBlock16()}

// hashBlock16 serves hybrid-mla-linear, whose hash blocks are 16 tokens.
func hashBlock16() *kvcore.Models {
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil || m.HashBlockSize != 16 {
		panic(fmt.Sprintf("hybrid-mla-linear: %v, hash block %d", err, m.HashBlockSize))
	}
	models, err := kvcore.NewModels("", m)
	if err != nil {
		panic(err)
	}
	return models
}

// admittedWith makes the step's event an admitted one of a 40-token
// prompt with a 2-hash chain and the given token ids.
func admittedWith(tokens int) func(*contract.EngineStep) {
	return func(s *contract.EngineStep) {
		e := &s.Requests[0]
		e.Kind, e.Step, e.PromptTokens, e.BlockHashes = contract.EventAdmitted, nil, 40, []string{"ab", "cd"}
		e.TokenIDs = make([]uint32, tokens)
	}
}

func TestDecodeClassifiesRecords(t *testing.T) {
	ev := contract.RequestEvent{RequestID: "r", Seq: 1, Kind: contract.EventScheduled, Step: &kvcore.Step{Kind: kvcore.StepPendingLoad}}
	st := contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: "e/1", EngineID: "e", Model: "m", Step: 1,
		Requests: []contract.RequestEvent{ev}}
	with := func(f func(*contract.EngineStep)) []byte {
		c := st
		c.Requests = append([]contract.RequestEvent(nil), st.Requests...)
		f(&c)
		return mustJSON(t, c)
	}
	res := contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "x", Kind: contract.TransferSave,
		TaskID: "t", EngineID: "e", RequestID: "r", Status: "stored"}
	dec := contract.LookupDecision{Schema: contract.SchemaLookupDecision, DecisionID: "d", EngineID: "e", RequestID: "r"}
	tooMany := make([]contract.RequestEvent, contract.MaxStepRequests+1)
	for i := range tooMany {
		tooMany[i] = contract.RequestEvent{RequestID: fmt.Sprint("r", i), Seq: 1, Kind: contract.EventFinished}
	}
	cases := []struct {
		name    string
		topic   string
		value   []byte
		reason  kvcore.Reason // "" = valid
		kind    string
		request string // the record's own request ("" for a step)
		changes int
	}{
		{"step", contract.TopicEngineSteps, mustJSON(t, st), "", ledger.KindStep, "", 1},
		{"empty step", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests = nil }), "", ledger.KindStep, "", 0},
		{"decision", contract.TopicLookupDecisions, mustJSON(t, dec), "", ledger.KindDecision, "r", 1},
		{"result", contract.TopicTransferResults, mustJSON(t, res), "", ledger.KindResult, "r", 1},
		{"not json", contract.TopicEngineSteps, []byte("{"), kvcore.ReasonUndecodable, "", "", 0},
		{"wrong schema", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Schema = "x" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"no step id", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.StepID = "" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"no engine id", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.EngineID = "" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"NUL in engine id", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.EngineID = "e\x00" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"no request id", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].RequestID = "" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"NUL in request id", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].RequestID = "r\x00" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"NUL in tenant", contract.TopicEngineSteps, with(func(s *contract.EngineStep) {
			s.Requests[0].Kind, s.Requests[0].Step, s.Requests[0].Tenant = contract.EventAdmitted, nil, "t\x00"
		}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"NUL in decision tenant", contract.TopicLookupDecisions, func() []byte { d := dec; d.Tenant = "t\x00"; return mustJSON(t, d) }(), kvcore.ReasonInvalidRecord, "", "", 0},
		{"seq 0", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].Seq = 0 }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"negative external", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].ExternalTokens = -1 }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"scheduled without step", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].Step = nil }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"hash not hex", contract.TopicEngineSteps, with(func(s *contract.EngineStep) {
			s.Requests[0].Kind, s.Requests[0].Step, s.Requests[0].BlockHashes = contract.EventAdmitted, nil, []string{"ab", "a,b"}
		}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"step hash not hex", contract.TopicEngineSteps, with(func(s *contract.EngineStep) {
			s.Requests[0].Step = &kvcore.Step{Kind: kvcore.StepNew, Hashes: []string{"XYZ"}}
		}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"admitted with whole blocks of tokens", contract.TopicEngineSteps, with(admittedWith(32)), "", ledger.KindStep, "", 1},
		{"admitted with one block of tokens", contract.TopicEngineSteps, with(admittedWith(16)), "", ledger.KindStep, "", 1},
		{"token ids of a partial block", contract.TopicEngineSteps, with(admittedWith(20)), kvcore.ReasonInvalidRecord, "", "", 0},
		{"token ids past the chain", contract.TopicEngineSteps, with(func(s *contract.EngineStep) {
			admittedWith(32)(s)
			s.Requests[0].BlockHashes, s.Requests[0].PromptTokens = []string{"ab"}, 64
		}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"token ids past the prompt", contract.TopicEngineSteps, with(func(s *contract.EngineStep) {
			admittedWith(32)(s)
			s.Requests[0].PromptTokens = 31
		}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"token ids on a scheduled event", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].TokenIDs = make([]uint32, 16) }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"NUL in lora name", contract.TopicEngineSteps, with(func(s *contract.EngineStep) {
			admittedWith(16)(s)
			s.Requests[0].LoraName = "l\x00"
		}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"unknown kind", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests[0].Kind = "exploded" }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"too many requests", contract.TopicEngineSteps, with(func(s *contract.EngineStep) { s.Requests = tooMany }), kvcore.ReasonInvalidRecord, "", "", 0},
		{"result without task", contract.TopicTransferResults, mustJSON(t, contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "x", Kind: "save", EngineID: "e", RequestID: "r"}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"result of unknown kind", contract.TopicTransferResults, mustJSON(t, func() contract.TransferResult { r := res; r.Kind = "copy"; return r }()), kvcore.ReasonInvalidRecord, "", "", 0},
		{"decision without id", contract.TopicLookupDecisions, mustJSON(t, contract.LookupDecision{Schema: contract.SchemaLookupDecision, EngineID: "e", RequestID: "r"}), kvcore.ReasonInvalidRecord, "", "", 0},
		{"other topic", "kvmesh.other", mustJSON(t, st), kvcore.ReasonUnknownTopic, "", "", 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			it, err := decode(bus.Received{Message: bus.Message{Topic: c.topic, Value: c.value}}, testRules)
			if c.reason == "" {
				if err != nil || it.record.Kind != c.kind || it.record.EngineID != "e" || it.record.RequestID != c.request || len(it.changes) != c.changes {
					t.Fatalf("decode: %+v with %d changes, %v", it.record, len(it.changes), err)
				}
				for _, ch := range it.changes {
					if ch.requestID != "r" {
						t.Errorf("change of request %q, want r", ch.requestID)
					}
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

// TestDecodeDropsTokenIDs checks the operator switch: with
// KVMESH_KV_EVENTS_TOKEN_IDS=false the admitted event applied has no token
// ids (its LoRA name stays), and a malformed list is still refused.
func TestDecodeDropsTokenIDs(t *testing.T) {
	ev := contract.RequestEvent{RequestID: "r", Seq: 1, Kind: contract.EventAdmitted, PromptTokens: 40,
		BlockHashes: []string{"ab", "cd"}, TokenIDs: make([]uint32, 32), LoraName: "sql"}
	st := contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: "e/1", EngineID: "e", Model: "m", Step: 1,
		Requests: []contract.RequestEvent{ev}}
	m := &kvcore.Model{Name: "m", HashBlockSize: 16}
	cases := []struct {
		name   string
		drop   bool
		tokens int
	}{
		{"kept", false, 32},
		{"dropped", true, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			it, err := decode(bus.Received{Message: bus.Message{Topic: contract.TopicEngineSteps, Value: mustJSON(t, st)}},
				rules{models: hashBlock16(), dropTokenIDs: c.drop})
			if err != nil || len(it.changes) != 1 {
				t.Fatalf("decode: %d changes, %v", len(it.changes), err)
			}
			req := requeststate.New(m, "e", "r")
			req.Apply(m, it.changes[0].event)
			if len(req.Store.TokenIDs) != c.tokens || req.Store.LoraName != "sql" {
				t.Fatalf("tracker keeps %d tokens, lora %q; want %d, sql", len(req.Store.TokenIDs), req.Store.LoraName, c.tokens)
			}
		})
	}
	bad := st
	bad.Requests = []contract.RequestEvent{ev}
	bad.Requests[0].TokenIDs = make([]uint32, 8)
	_, err := decode(bus.Received{Message: bus.Message{Topic: contract.TopicEngineSteps, Value: mustJSON(t, bad)}},
		rules{models: hashBlock16(), dropTokenIDs: true})
	var pe *bus.PermanentError
	if !errors.As(err, &pe) || pe.Reason != kvcore.ReasonInvalidRecord {
		t.Fatalf("malformed token ids with the switch off: %v, want permanent %s", err, kvcore.ReasonInvalidRecord)
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

// TestMessagesValuesAreEncodingJSON: the tasks' own encoders write what
// encoding/json wrote before them.
func TestMessagesValuesAreEncodingJSON(t *testing.T) {
	out := trackingOutcome()
	out.Saves[0].BlockTable = kvcore.BlockTable{{1, kvcore.NullBlock, 3}, {4}}
	out.Saves[0].BlockHashes, out.Saves[0].TokenIDs, out.Saves[0].Tenant = []string{"ab", "cd"}, []uint32{1, 2, 3}, "t<&>"
	out.Saves[0].Groups = []kvcore.GroupChunks{{Group: 1, Chunks: []kvcore.Chunk{{Start: 0, End: 16}}}}
	out.Loads[0].Remote = &kvcore.RemoteSource{EngineID: "p", BlockTable: kvcore.BlockTable{{9}}}
	out.Loads[0].Ranks = []kvcore.Rank{{TP: 1}}
	msgs, err := Messages(out)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range []any{out.Saves[0], out.Loads[0], out.Feedback[0]} {
		want, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(msgs[i].Value, want) {
			t.Errorf("message %d:\n got %s\nwant %s", i, msgs[i].Value, want)
		}
	}
}

// trackingOutcome is an outcome with one save, one load and one feedback.
func trackingOutcome() requeststate.Outcome {
	return requeststate.Outcome{
		Saves:    []kvcore.SaveTask{{TaskID: "s", EngineID: "e", RequestID: "r"}},
		Loads:    []kvcore.LoadTask{{TaskID: "l", EngineID: "e", RequestID: "r"}},
		Feedback: []contract.EngineFeedback{{Feedback: kvcore.Feedback{Kind: kvcore.FeedbackFinishedSending, EngineID: "e", RequestID: "r"}}},
	}
}

func TestClassifyApply(t *testing.T) {
	cases := []struct {
		name      string
		err       error
		permanent bool
	}{
		{"data exception", fmt.Errorf("ledger: store: %w", &pgconn.PgError{Code: "22021"}), true},
		{"integrity", &pgconn.PgError{Code: "23505"}, true},
		{"deadlock", &pgconn.PgError{Code: "40P01"}, false},
		{"connection", errors.New("dial tcp: connection refused"), false},
		{"corrupt parts", fmt.Errorf("ledger: read hashes: %w", ledger.ErrPartsCorrupt), true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var pe *bus.PermanentError
			got := errors.As(classifyApply(c.err), &pe)
			if got != c.permanent {
				t.Fatalf("classifyApply(%v): permanent %v (%+v), want %v", c.err, got, pe, c.permanent)
			}
		})
	}
}
