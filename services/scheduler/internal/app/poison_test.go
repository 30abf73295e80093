package app_test

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestPoisonRecordsAreDeadLettered checks, for each topic the scheduler
// consumes, that a maximum-size junk record, a truncated record and a
// record of another schema are each dead-lettered into
// dead_letters (service scheduler) with a reason, that /readyz stays 200, and that the
// valid record after each (on the same partition) takes effect within
// servicetest.PoisonDeadline.
func TestPoisonRecordsAreDeadLettered(t *testing.T) {
	h := newMesh(t, meshOptions{})
	sample := h.request("sample")
	event := sample.fill(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(16)})
	decision := sample.decision("d1", "", 0, storeChild(0, nil))
	result := sample.transferResult(contract.TransferResult{Kind: contract.TransferSave, TaskID: "t1", Status: string(kvcore.SaveStored)})
	saveTask := kvcore.SaveTask{Schema: kvcore.SchemaSaveTask, TaskID: "t1", EngineID: sample.engine, RequestID: sample.id,
		Model: h.model.Name, End: 16, BlockTable: table(0, 1), BlockHashes: hashes(1)}
	cases := []struct {
		topic         string
		sample, wrong any
		next          func(t *testing.T, h *mesh) servicetest.Valid
	}{
		{contract.TopicEngineSteps, event, decision, nextAdmission},
		{contract.TopicLookupDecisions, decision, event, nextDecision},
		{contract.TopicTransferResults, result, saveTask, nextResult},
	}
	for _, c := range cases {
		t.Run(c.topic, func(t *testing.T) {
			h := h.on(t)
			servicetest.RunPoison(t, servicetest.PoisonTopic{
				Topic: c.topic, Addr: h.addr, Brokers: h.brokers,
				Sample: mustMarshal(t, c.sample), WrongSchema: mustMarshal(t, c.wrong),
				Next:       func(t *testing.T) servicetest.Valid { return c.next(t, h.on(t)) },
				DeadLetter: h.deadLetterReason,
			})
		})
	}
}

// nextAdmission is an admitted event of a fresh request, applied once the
// request's tracker shows up.
func nextAdmission(t *testing.T, h *mesh) servicetest.Valid {
	r := h.request("poison")
	ev := r.fill(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(16)})
	return servicetest.Valid{Key: r.engine, Value: mustMarshal(t, ev), Applied: func() bool {
		d, ok := r.detail()
		return ok && d.LastSeq == 1
	}}
}

// nextDecision is the lookup decision that a fresh request's allocation
// (already produced, so held) waits for, applied once the load task it
// releases is published.
func nextDecision(t *testing.T, h *mesh) servicetest.Valid {
	r := h.request("poison")
	r.admit(48)
	r.allocate(32, table(0, 3), "d1")
	r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	d := r.decision("d1", "store", 32, storeChild(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	return servicetest.Valid{Key: r.id, Value: mustMarshal(t, d), Applied: func() bool { return len(r.loads()) == 1 }}
}

// nextResult is the stored result of a fresh request's outstanding save
// task, applied once the request has no task left.
func nextResult(t *testing.T, h *mesh) servicetest.Valid {
	r := h.request("poison")
	r.admit(33)
	r.decide("d1", "", 0, storeChild(0, nil))
	r.allocate(0, table(0, 3), "d1")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 33, Table: table(0, 3)})
	task := r.waitSaves(1)[0]
	if d := r.applied(); len(d.Tasks) != 1 {
		t.Fatalf("tasks before the result: %+v, want the save task", d.Tasks)
	}
	res := r.transferResult(contract.TransferResult{Kind: contract.TransferSave, TaskID: task.TaskID, Status: string(kvcore.SaveStored)})
	return servicetest.Valid{Key: r.id, Value: mustMarshal(t, res), Applied: func() bool {
		d, ok := r.detail()
		return ok && len(d.Tasks) == 0
	}}
}

// deadLetterReason is the reason of the scheduler's dead letter of the
// record at, or "" while there is none.
func (h *mesh) deadLetterReason(t *testing.T, at servicetest.Produced) string {
	var reason string
	err := h.pool.QueryRow(h.ctx, `SELECT reason FROM dead_letters
		WHERE service = 'scheduler' AND topic = $1 AND partition = $2 AND "offset" = $3`, at.Topic, at.Partition, at.Offset).Scan(&reason)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("dead letter of %+v: %v", at, err)
	}
	return reason
}

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := jsonValue(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
