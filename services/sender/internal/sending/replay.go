package sending

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// Replay errors; see Replay.
var (
	// ErrStillInvalid: the stored payload is still invalid for the current
	// model. It is wrapped in an *InvalidError.
	ErrStillInvalid = errors.New("dead letter is still invalid")
	// ErrReplayFailed: the payload is valid now but the save did not
	// complete (store or worker unavailable, store full).
	ErrReplayFailed = errors.New("replay did not store every key")
)

// InvalidError says why a replayed dead letter is still invalid.
type InvalidError struct {
	// Group is the group found invalid (nil: the record as a whole).
	Group *int
	// Reason is the reason code found now.
	Reason string
	// Detail explains it.
	Detail string
}

// Error describes the fault.
func (e *InvalidError) Error() string {
	return fmt.Sprintf("%s: %s: %s", ErrStillInvalid, e.Reason, e.Detail)
}

// Unwrap returns ErrStillInvalid.
func (e *InvalidError) Unwrap() error { return ErrStillInvalid }

// ReplayResult is the recorded result of a replay attempt.
type ReplayResult = adminapi.ReplayResult

// Replayed is what Replay answers.
type Replayed struct {
	// DeadLetter is the entry after the replay was recorded.
	DeadLetter ledger.DeadLetter
	// Result is the replay's result (the recorded one for an entry replayed
	// before).
	Result ReplayResult
	// Already is set when the entry had been replayed successfully before
	// and nothing was done now.
	Already bool
}

// Replay re-validates dead letter id's stored payload against the current
// model, for the entry's group (every group for a whole-record entry), and
// when it is valid now saves those groups and records the result. An entry
// already replayed successfully is a no-op that answers its recorded
// result. Errors: ledger.ErrNotFound; an *InvalidError (ErrStillInvalid)
// when the payload is still invalid; ErrReplayFailed (with the result
// recorded) when the save did not complete.
func (p *Processor) Replay(ctx context.Context, id int64) (Replayed, error) {
	out, err := p.replay(ctx, id)
	p.metrics.countReplay(replayResult(out, err))
	return out, err
}

// replayResult classifies a replay's outcome for kvmesh_dlq_replays_total.
func replayResult(out Replayed, err error) string {
	switch {
	case errors.Is(err, ErrStillInvalid):
		return ReplayInvalid
	case errors.Is(err, ErrReplayFailed):
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
func (p *Processor) replay(ctx context.Context, id int64) (Replayed, error) {
	p.replayMu.Lock()
	defer p.replayMu.Unlock()
	d, err := p.ledger.Get(ctx, id)
	if err != nil {
		return Replayed{}, err
	}
	if d.ReplayStatus == ledger.ReplayDone {
		return recorded(d)
	}
	task, groups, invalid := p.replayPlan(d)
	if invalid != nil {
		res := ReplayResult{Status: ledger.ReplayInvalid, Reason: invalid.Reason, Detail: invalid.Detail}
		if _, _, err := p.ledger.RecordReplay(ctx, id, ledger.ReplayInvalid, res); err != nil {
			return Replayed{}, err
		}
		return Replayed{}, invalid
	}
	s := newSave(task)
	p.saveGroups(ctx, s, groups, false)
	if err := ctx.Err(); err != nil {
		return Replayed{}, err
	}
	return p.recordReplay(ctx, d, s)
}

// recorded answers the recorded result of an entry replayed before.
func recorded(d ledger.DeadLetter) (Replayed, error) {
	out := Replayed{DeadLetter: d, Already: true}
	if err := json.Unmarshal(d.ReplayResult, &out.Result); err != nil {
		return Replayed{}, fmt.Errorf("dead letter %d: replay result: %w", d.ID, err)
	}
	return out, nil
}

// replayPlan decodes the entry's payload and picks the groups to save, or
// says why the entry is still invalid.
func (p *Processor) replayPlan(d ledger.DeadLetter) (*kvcore.SaveTask, []int, *InvalidError) {
	task, err := decodeTask(d.Payload)
	if err != nil {
		return nil, nil, &InvalidError{Group: d.Group, Reason: kvcore.ReasonUndecodable, Detail: err.Error()}
	}
	var groups []int
	for _, v := range kvcore.ValidateSave(p.model, nil, task) {
		if d.Group != nil && v.Group != *d.Group {
			continue
		}
		if !v.OK() {
			g := v.Group
			return nil, nil, &InvalidError{Group: &g, Reason: string(v.Reason), Detail: v.Detail}
		}
		groups = append(groups, v.Group)
	}
	if len(groups) == 0 {
		return nil, nil, &InvalidError{Group: d.Group, Reason: string(kvcore.ReasonGroupOutOfRange),
			Detail: fmt.Sprintf("model %q has no group %v", p.model.Name, derefGroup(d.Group))}
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
func (p *Processor) recordReplay(ctx context.Context, d ledger.DeadLetter, s *save) (Replayed, error) {
	tr := s.result()
	res := ReplayResult{Status: tr.Status, Groups: tr.Groups, Bytes: tr.Bytes}
	status := ledger.ReplayDone
	var msgs []bus.Message
	if t := s.totals(); t.Failed+t.DeadLettered+t.Skipped > 0 {
		status, res.Reason = ledger.ReplayFailed, t.Reason
		for _, dl := range s.deadLetters {
			res.Detail = dl.Detail
		}
	} else {
		var err error
		if msgs, err = resultMessages(tr, s.kvEvents(p.model, p.now()), p.form); err != nil {
			return Replayed{}, err
		}
		msgs = msgs[1:] // the task's result was reported when it was dead-lettered
	}
	row, applied, err := p.ledger.RecordReplay(ctx, d.ID, status, res, msgs...)
	if err != nil {
		return Replayed{}, err
	}
	if !applied {
		return recorded(row)
	}
	out := Replayed{DeadLetter: row, Result: res}
	if status == ledger.ReplayFailed {
		return out, fmt.Errorf("dead letter %d: %w: %s", d.ID, ErrReplayFailed, res.Reason)
	}
	return out, nil
}
