package sending

import (
	"context"
	"encoding/json"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/text"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// maxDetail bounds the error text kept with a whole-record dead letter.
const maxDetail = 2000

// DeadLetter is the consumer's bus.DeadLetterFunc: a record that is not a
// save task (undecodable), whose handler panicked (handler_panic) or kept
// failing (retries_exhausted) is dead-lettered whole, and its task, when its ids can be read, is reported
// dead_lettered so the request's blocks are freed.
func (p *Processor) DeadLetter(ctx context.Context, m bus.Received, reason kvcore.Reason, cause error) error {
	return p.recordBroken(ctx, sourceOf(m), reason, cause)
}

// taskIDs are the identifying fields of a save task, read leniently from a
// record that may not decode as a task.
type taskIDs struct {
	Schema    string `json:"schema"`
	TaskID    string `json:"task_id"`
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	Model     string `json:"model"`
}

// recordBroken writes one whole-record dead letter for src. When the
// record names a save task (no schema, or the save-task schema), engine
// and request, the task also gets an outcome:
// every model group dead-lettered with reason, reported on
// transfer.results, unless an outcome is already recorded.
func (p *Processor) recordBroken(ctx context.Context, src ledger.Source, reason kvcore.Reason, cause error) error {
	var ids taskIDs
	_ = json.Unmarshal(src.Payload, &ids) // best effort: a record need not be JSON
	s := p.newSave(&kvcore.SaveTask{TaskID: ids.TaskID, EngineID: ids.EngineID, RequestID: ids.RequestID, Model: ids.Model})
	detail := ""
	if cause != nil {
		detail = text.Truncate(cause.Error(), maxDetail)
	}
	s.addDeadLetter(nil, reason, detail)
	entry := ledger.Entry{Source: src, DeadLetters: s.deadLetters}
	// A record of another schema (a load task on the wrong topic, say) names
	// no save task: reporting a save result for its id would confuse the
	// scheduler.
	complete := usableID(ids.TaskID) && usableID(ids.EngineID) && usableID(ids.RequestID) &&
		(ids.Schema == "" || ids.Schema == kvcore.SchemaSaveTask)
	if complete {
		for g := range s.m.Groups {
			s.record(g, keysDeadLettered, 1, reason)
		}
		var err error
		if entry, err = s.entry(src, p.now(), p.form); err != nil {
			return err
		}
	}
	c, err := p.ledger.Commit(ctx, entry)
	if err != nil {
		return err
	}
	p.countDeadLetters(ctx, c.DeadLetters)
	switch {
	case !complete:
		if len(c.DeadLetters) > 0 {
			p.metrics.tasks.WithLabelValues(string(kvcore.ReasonUndecodable)).Inc()
		}
	case !c.Done:
		p.metrics.countOutcome(entry.Outcome)
	}
	return nil
}

// usableID reports whether a salvaged id can name a task.
func usableID(s string) bool { return s != "" && text.PostgresSafe(s) }
