// Package sendingtest runs save tasks through the sender's real
// sending.Processor against in-memory parts, in the style of river's
// rivertest.Worker: a Ledger in place of PostgreSQL, a Store in place of
// Redis and a Worker in place of the gpuworkers, so that the save path's
// outcomes, dead letters and messages can be checked with no service
// running. Worker (harness.go) builds a Processor over them and hands back,
// per record, what the handling recorded.
package sendingtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/text"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

// ErrInjected is the failure a test part returns when told to fail.
var ErrInjected = errors.New("sendingtest: injected failure")

var _ sending.Ledger = (*Ledger)(nil)

// Ledger is sending.Ledger in memory, with the pgx ledger's rules
// (ledger.Ledger): an outcome per task id, dead letters kept once per
// record slot, the DLQ message of each dead letter written and the entry's
// messages only with a new outcome, all applied at once or not at all. It
// is safe for concurrent use.
type Ledger struct {
	mu          sync.Mutex
	now         func() time.Time
	outcomes    map[string]ledger.Outcome
	deadLetters []deadletter.DeadLetter
	slots       map[slotKey]bool
	outbox      []bus.Message
	failCommits int
	commits     int
}

// slotKey is the dead_letters table's unique key.
type slotKey struct {
	topic      string
	partition  int
	offset     int64
	recordTime time.Time
	slot       int
}

// NewLedger returns an empty ledger; now stamps the rows (nil: time.Now).
func NewLedger(now func() time.Time) *Ledger {
	if now == nil {
		now = time.Now
	}
	return &Ledger{now: now, outcomes: map[string]ledger.Outcome{}, slots: map[slotKey]bool{}}
}

// FailCommits makes the next n commits fail with ErrInjected, writing
// nothing, as a database that is down would.
func (l *Ledger) FailCommits(n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failCommits = n
}

// Commit writes e as ledger.Ledger.Commit does, in one step.
func (l *Ledger) Commit(_ context.Context, e ledger.Entry) (ledger.Committed, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.commits++
	if l.failCommits > 0 {
		l.failCommits--
		return ledger.Committed{}, fmt.Errorf("ledger: commit %s/%d@%d: %w", e.Source.Topic, e.Source.Partition, e.Source.Offset, ErrInjected)
	}
	var out ledger.Committed
	fresh := true
	if e.Outcome != nil {
		_, done := l.outcomes[e.Outcome.Result.TaskID]
		fresh = !done
		if done && e.DropIfDone {
			return ledger.Committed{Done: true}, nil
		}
		out.Done = done
	}
	rows, msgs, err := l.newDeadLetters(e.Source, e.DeadLetters)
	if err != nil {
		return ledger.Committed{}, fmt.Errorf("ledger: commit %s/%d@%d: %w", e.Source.Topic, e.Source.Partition, e.Source.Offset, err)
	}
	if fresh {
		msgs = append(msgs, e.Messages...)
		if e.Outcome != nil {
			l.outcomes[e.Outcome.Result.TaskID] = *e.Outcome
		}
	}
	for _, d := range rows {
		l.slots[slotKey{d.Topic, d.Partition, d.Offset, d.RecordTime, d.Slot}] = true
	}
	l.deadLetters = append(l.deadLetters, rows...)
	l.outbox = append(l.outbox, msgs...)
	out.DeadLetters = rows
	return out, nil
}

// newDeadLetters numbers the dead letters of src not yet recorded and
// returns them with their DLQ messages, recording nothing.
func (l *Ledger) newDeadLetters(src ledger.Source, dls []deadletter.DeadLetter) ([]deadletter.DeadLetter, []bus.Message, error) {
	payload := src.Payload
	if payload == nil {
		payload = []byte{}
	}
	var rows []deadletter.DeadLetter
	var msgs []bus.Message
	seen := map[int]bool{}
	for _, d := range dls {
		if seen[d.Slot] || l.slots[slotKey{src.Topic, src.Partition, src.Offset, src.Time, d.Slot}] {
			continue // this record's slot is already recorded
		}
		seen[d.Slot] = true
		d.Reason, d.Detail = kvcore.Reason(text.ForPostgres(string(d.Reason))), text.ForPostgres(d.Detail)
		d.TaskID, d.EngineID, d.RequestID = text.ForPostgres(d.TaskID), text.ForPostgres(d.EngineID), text.ForPostgres(d.RequestID)
		d.Payload, d.Topic, d.Partition, d.Offset, d.RecordTime = payload, src.Topic, src.Partition, src.Offset, src.Time
		d.ReplayStatus = deadletter.ReplayNone
		d.ID, d.CreatedAt = int64(len(l.deadLetters)+len(rows)+1), l.now()
		m, err := deadletter.Message(d)
		if err != nil {
			return nil, nil, err
		}
		rows = append(rows, d)
		msgs = append(msgs, m)
	}
	return rows, msgs, nil
}

// Get returns dead letter id, or an error wrapping deadletter.ErrNotFound.
func (l *Ledger) Get(_ context.Context, id int64) (deadletter.DeadLetter, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, err := l.index(id)
	if err != nil {
		return deadletter.DeadLetter{}, err
	}
	return l.deadLetters[i], nil
}

func (l *Ledger) index(id int64) (int, error) {
	if id < 1 || id > int64(len(l.deadLetters)) {
		return 0, fmt.Errorf("dead letter %d: %w", id, deadletter.ErrNotFound)
	}
	return int(id - 1), nil
}

// RecordReplay records a replay attempt as ledger.Ledger.RecordReplay does:
// an entry replayed before is left as it is (applied false).
func (l *Ledger) RecordReplay(_ context.Context, id int64, status string, result any, msgs ...bus.Message) (deadletter.DeadLetter, bool, error) {
	body, err := json.Marshal(result)
	if err != nil {
		return deadletter.DeadLetter{}, false, fmt.Errorf("ledger: encode replay result: %w", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	i, err := l.index(id)
	if err != nil {
		return deadletter.DeadLetter{}, false, err
	}
	d := &l.deadLetters[i]
	if d.ReplayStatus == deadletter.ReplayDone {
		return *d, false, nil
	}
	at := l.now()
	d.ReplayStatus, d.ReplayCount, d.ReplayedAt, d.ReplayResult = status, d.ReplayCount+1, &at, body
	l.outbox = append(l.outbox, msgs...)
	return *d, true, nil
}

// Outcome returns the outcome recorded for a task.
func (l *Ledger) Outcome(taskID string) (ledger.Outcome, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	o, ok := l.outcomes[taskID]
	return o, ok
}

// DeadLetters returns every dead letter, oldest first.
func (l *Ledger) DeadLetters() []deadletter.DeadLetter {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]deadletter.DeadLetter(nil), l.deadLetters...)
}

// Outbox returns every message enqueued, oldest first.
func (l *Ledger) Outbox() []bus.Message {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]bus.Message(nil), l.outbox...)
}

// Commits counts the commits asked for, failed ones included.
func (l *Ledger) Commits() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.commits
}

// marks are the lengths of the ledger's lists, to tell what one record
// added.
type marks struct{ deadLetters, outbox int }

func (l *Ledger) mark() marks {
	l.mu.Lock()
	defer l.mu.Unlock()
	return marks{len(l.deadLetters), len(l.outbox)}
}

// since returns the dead letters and messages added after m.
func (l *Ledger) since(m marks) ([]deadletter.DeadLetter, []bus.Message) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]deadletter.DeadLetter(nil), l.deadLetters[m.deadLetters:]...), append([]bus.Message(nil), l.outbox[m.outbox:]...)
}
