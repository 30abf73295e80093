package app_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestPoisonSaveTasksAreDeadLettered checks the sender's one consumed topic,
// kvmesh.save.tasks: a maximum-size junk record, a truncated save task and
// a load task are each dead-lettered with a reason, in the dead_letters
// table and on kvmesh.save.dlq; /readyz stays 200; and the valid save after
// each (on the same partition) is stored and its result published within
// servicetest.PoisonDeadline.
func TestPoisonSaveTasksAreDeadLettered(t *testing.T) {
	s := newStack(t, stackOptions{engines: []string{"e1"}})
	sample := s.task(t, "e1", "poison-sample", 0, 32, 0)
	wrong := kvcore.LoadTask{Schema: kvcore.SchemaLoadTask, TaskID: "load-" + randHex(4), EngineID: "e1",
		RequestID: "poison-wrong", Model: s.model.Name, Connector: "store", End: 32,
		BlockTable: sample.BlockTable, BlockHashes: sample.BlockHashes, Groups: s.model.LoadGroups(0, 32)}
	servicetest.RunPoison(t, servicetest.PoisonTopic{
		Topic: contract.TopicSaveTasks, Addr: s.sender, Brokers: s.env.Brokers,
		Sample: mustJSON(t, sample), WrongSchema: mustJSON(t, wrong),
		Next: func(t *testing.T) servicetest.Valid {
			task := s.task(t, "e1", "poison-"+randHex(4), 0, 32, 0)
			return servicetest.Valid{Key: task.RequestID, Value: mustJSON(t, task), Applied: func() bool {
				res, ok := s.got.find(task.TaskID)
				return ok && res.Status == string(kvcore.SaveStored)
			}}
		},
		DeadLetter: s.deadLetterReason,
	})
}

// deadLetterReason is the reason of the sender's whole-record dead letter of
// the record at, once it is both in the dead_letters table and on
// kvmesh.save.dlq with the same reason; "" until then.
func (s *stack) deadLetterReason(t *testing.T, at servicetest.Produced) string {
	var reason string
	err := s.db.QueryRow(context.Background(), `SELECT reason FROM dead_letters
		WHERE topic = $1 AND partition = $2 AND "offset" = $3 AND group_index IS NULL`,
		at.Topic, at.Partition, at.Offset).Scan(&reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	if err != nil {
		t.Fatalf("dead letter of %+v: %v", at, err)
	}
	s.got.mu.Lock()
	defer s.got.mu.Unlock()
	for _, d := range s.got.dlq {
		if d.Topic == at.Topic && d.Partition == at.Partition && d.Offset == at.Offset && d.Group == nil {
			if d.Reason != reason {
				t.Fatalf("dead letter of %+v: reason %q on %s, %q in the table", at, d.Reason, contract.TopicSaveDLQ, reason)
			}
			return reason
		}
	}
	return ""
}

// find returns the transfer result of taskID, if one was published.
func (c *collector) find(taskID string) (contract.TransferResult, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range c.results {
		if r.TaskID == taskID {
			return r, true
		}
	}
	return contract.TransferResult{}, false
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
