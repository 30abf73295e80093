package sending

import (
	"slices"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// Group outcomes, as counted in save_outcomes and kvmesh_sender_groups_total.
const (
	groupStored       = "stored"
	groupExisting     = "existing"
	groupSkipped      = "skipped"
	groupDeadLettered = "dead_lettered"
	groupFailed       = "failed"
)

// run accumulates what happens to one save task (or one replayed group).
type run struct {
	task        *kvcore.SaveTask
	outcome     kvcore.SendOutcome
	deadLetters []ledger.DeadLetter
	stored      map[int][]string
	bytes       int64
}

func newRun(t *kvcore.SaveTask) *run {
	return &run{task: t, outcome: kvcore.NewSendOutcome(t), stored: map[int][]string{}}
}

// deadLetter dead-letters keys of group with reason: counted in the
// outcome and written as a dead letter of the task.
func (r *run) deadLetter(group int, reason kvcore.Reason, detail string, keys int) {
	r.outcome.Record(group, kvcore.OutcomeDeadLettered, keys, reason)
	r.addDeadLetter(&group, string(reason), detail)
}

// addDeadLetter adds a dead-letter row for group (nil: the whole task).
func (r *run) addDeadLetter(group *int, reason, detail string) {
	slot := len(r.deadLetters)
	if group == nil {
		slot = ledger.WholeRecord
	}
	r.deadLetters = append(r.deadLetters, ledger.DeadLetter{
		Reason: reason, Detail: detail, Group: group, Slot: slot,
		TaskID: r.task.TaskID, EngineID: r.task.EngineID, RequestID: r.task.RequestID,
	})
}

// groupCounts classifies each recorded group by its worst outcome.
func (r *run) groupCounts() map[string]int {
	out := map[string]int{}
	for _, g := range r.outcome.Groups {
		out[classify(g)]++
	}
	return out
}

func classify(g kvcore.GroupOutcome) string {
	switch {
	case g.Failed > 0:
		return groupFailed
	case g.DeadLettered > 0:
		return groupDeadLettered
	case g.Skipped > 0:
		return groupSkipped
	case g.Stored > 0:
		return groupStored
	}
	return groupExisting
}

// resultID is the TransferResult id of a task: stable across redelivery.
func resultID(taskID string) string { return "save/" + taskID }

// result is the task's TransferResult.
func (r *run) result() contract.TransferResult {
	groups := make([]contract.GroupOutcome, 0, len(r.outcome.Groups))
	for _, g := range r.outcome.Groups {
		groups = append(groups, contract.GroupOutcome{
			Group: g.Group, Stored: g.Stored, Existing: g.Existed, Skipped: g.Skipped,
			DeadLettered: g.DeadLettered, Failed: g.Failed, Reason: string(g.Reason),
		})
	}
	return contract.TransferResult{
		Schema: contract.SchemaTransferResult, ResultID: resultID(r.task.TaskID), Kind: contract.TransferSave,
		TaskID: r.task.TaskID, EngineID: r.task.EngineID, RequestID: r.task.RequestID,
		Status: string(r.outcome.Status()), Groups: groups, Bytes: r.bytes,
	}
}

// kvEvents are the BlockStored events of the keys put, one per group.
func (r *run) kvEvents(model string) []contract.KVEvent {
	groups := make([]int, 0, len(r.stored))
	for g := range r.stored {
		groups = append(groups, g)
	}
	slices.Sort(groups)
	out := make([]contract.KVEvent, 0, len(groups))
	for _, g := range groups {
		out = append(out, contract.KVEvent{
			Schema: contract.SchemaKVEvent, Kind: contract.BlockStored, Model: model,
			EngineID: r.task.EngineID, RequestID: r.task.RequestID, Group: g, Keys: r.stored[g],
		})
	}
	return out
}
