package sending

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Replay re-validates dead letter id's stored payload against the current
// model, for the entry's group (every group for a whole-record entry), and
// when it is valid now saves those groups and records the result. An entry
// already replayed successfully is a no-op that answers its recorded
// result. Errors: deadletter.ErrNotFound; an *deadletter.InvalidError (ErrStillInvalid)
// when the payload is still invalid; deadletter.ErrReplayFailed (with the result
// recorded) when the save did not complete.
func (p *Processor) Replay(ctx context.Context, id int64) (deadletter.Replayed, error) {
	out, err := p.replay(ctx, id)
	p.metrics.countReplay(replayResult(out, err))
	return out, err
}

// replayResult classifies a replay's outcome for kvmesh_dlq_replays_total.
func replayResult(out deadletter.Replayed, err error) string {
	switch {
	case errors.Is(err, deadletter.ErrStillInvalid):
		return ReplayInvalid
	case errors.Is(err, deadletter.ErrReplayFailed):
		return ReplayFailed
	case err != nil:
		return ReplayError
	case out.Already:
		return ReplayAlready
	default:
		return ReplayReplayed
	}
}

// replay is Replay without the counting.
func (p *Processor) replay(ctx context.Context, id int64) (deadletter.Replayed, error) {
	p.replayMu.Lock()
	defer p.replayMu.Unlock()
	d, err := p.ledger.Get(ctx, id)
	if err != nil {
		return deadletter.Replayed{}, err
	}
	if d.ReplayStatus == deadletter.ReplayDone {
		return deadletter.Recorded(d)
	}
	task, groups, invalid := p.replayPlan(d)
	if invalid != nil {
		res := deadletter.ReplayResult{Status: deadletter.ReplayInvalid, Reason: invalid.Reason, Detail: invalid.Detail}
		if _, _, err := p.ledger.RecordReplay(ctx, id, deadletter.ReplayInvalid, res); err != nil {
			return deadletter.Replayed{}, err
		}
		return deadletter.Replayed{}, invalid
	}
	s := p.newSave(task)
	p.saveGroups(ctx, s, groups, false)
	if err := ctx.Err(); err != nil {
		return deadletter.Replayed{}, err
	}
	return p.recordReplay(ctx, d, s)
}

// replayPlan decodes the entry's payload and picks the groups to save, or
// says why the entry is still invalid.
func (p *Processor) replayPlan(d deadletter.DeadLetter) (*kvcore.SaveTask, []int, *deadletter.InvalidError) {
	task, err := decodeTask(d.Payload)
	if err != nil {
		return nil, nil, &deadletter.InvalidError{Group: d.Group, Reason: kvcore.ReasonUndecodable, Detail: err.Error()}
	}
	var groups []int
	m := p.newSave(task).m
	for _, v := range kvcore.ValidateSave(m, nil, task) {
		if d.Group != nil && v.Group != *d.Group {
			continue
		}
		if !v.OK() {
			g := v.Group
			return nil, nil, &deadletter.InvalidError{Group: &g, Reason: v.Reason, Detail: v.Detail}
		}
		groups = append(groups, v.Group)
	}
	if len(groups) == 0 {
		return nil, nil, &deadletter.InvalidError{Group: d.Group, Reason: kvcore.ReasonGroupOutOfRange,
			Detail: fmt.Sprintf("model %q has no group %v", m.Name, derefGroup(d.Group))}
	}
	return task, groups, nil
}

func derefGroup(g *int) any {
	if g == nil {
		return "(none)"
	}
	return *g
}

// recordReplay records the replay's result: replayed (with the BlockStored
// events of the keys put) when every key is stored or present, else failed.
func (p *Processor) recordReplay(ctx context.Context, d deadletter.DeadLetter, s *save) (deadletter.Replayed, error) {
	tr := s.result()
	res := deadletter.ReplayResult{Status: tr.Status, Groups: tr.Groups, Bytes: tr.Bytes}
	status := deadletter.ReplayDone
	var msgs []bus.Message
	if t := s.totals(); t.Failed+t.DeadLettered+t.Skipped > 0 {
		status, res.Reason = deadletter.ReplayFailed, kvcore.Reason(t.Reason)
		for _, dl := range s.deadLetters {
			res.Detail = dl.Detail
		}
	} else {
		var err error
		if msgs, err = resultMessages(tr, s.kvEvents(p.now()), p.form); err != nil {
			return deadletter.Replayed{}, err
		}
		msgs = msgs[1:] // the task's result was reported when it was dead-lettered
	}
	row, applied, err := p.ledger.RecordReplay(ctx, d.ID, status, res, msgs...)
	if err != nil {
		return deadletter.Replayed{}, err
	}
	if !applied {
		return deadletter.Recorded(row)
	}
	out := deadletter.Replayed{DeadLetter: row, Result: res}
	if status == deadletter.ReplayFailed {
		return out, fmt.Errorf("dead letter %d: %w: %s", d.ID, deadletter.ErrReplayFailed, res.Reason)
	}
	return out, nil
}
