package app_test

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestPoisonLoadTasksAreDeadLettered checks the gpuworker's one consumed
// topic, kvmesh.load.tasks: a maximum-size junk record, a truncated load
// task and a save task, each keyed to this engine, are dead-lettered (the
// worker has no DLQ topic: its dead letters are log records naming the
// record and the reason); /readyz stays 200; and the valid load after each
// (on the same partition) is answered on kvmesh.transfer.results within
// servicetest.PoisonDeadline.
func TestPoisonLoadTasksAreDeadLettered(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	logs := &captured{}
	w := startWorkerLogging(t, testConfig(env, "engine-poison"), nil, slog.New(logs))
	rs := watchResults(t, env)
	table := kvcore.BlockTable{{1}, {2}}
	sample := w.loadTask(hexChain(w.model, tokens(16, 900)), 16, table)
	wrong := kvcore.SaveTask{Schema: kvcore.SchemaSaveTask, TaskID: "save-" + randomHex(4), EngineID: w.cfg.EngineID,
		RequestID: sample.RequestID, Model: w.model.Name, End: 16, BlockTable: table, BlockHashes: sample.BlockHashes,
		Groups: w.model.SaveGroups(0, 16)}
	servicetest.RunPoison(t, servicetest.PoisonTopic{
		Topic: contract.TopicLoadTasks, Addr: w.app.Addr(), Brokers: env.Brokers,
		Sample: mustJSON(t, sample), WrongSchema: mustJSON(t, wrong),
		Next: func(t *testing.T) servicetest.Valid {
			task := w.loadTask(hexChain(w.model, tokens(16, 900)), 16, table)
			return servicetest.Valid{Key: w.cfg.EngineID, Value: mustJSON(t, task), Applied: func() bool {
				got := rs.find(task.TaskID)
				return len(got) == 1 && got[0].Kind == contract.TransferLoad && got[0].EngineID == w.cfg.EngineID
			}}
		},
		DeadLetter: func(_ *testing.T, at servicetest.Produced) string { return logs.deadLetterReason(at) },
	})
	if got := rs.find(wrong.TaskID); len(got) != 0 {
		t.Fatalf("the save task on %s was answered: %+v", contract.TopicLoadTasks, got)
	}
}

// captured is a slog.Handler that keeps every record, with its attributes
// flattened to strings.
type captured struct {
	mu      sync.Mutex
	records []capturedRecord
	attrs   []slog.Attr // of a handler derived with WithAttrs
	parent  *captured   // the handler that keeps the records
}

// capturedRecord is one log record.
type capturedRecord struct {
	msg   string
	attrs map[string]string
}

func (c *captured) Enabled(context.Context, slog.Level) bool { return true }

func (c *captured) Handle(_ context.Context, r slog.Record) error {
	rec := capturedRecord{msg: r.Message, attrs: map[string]string{}}
	for _, a := range c.attrs {
		rec.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool {
		rec.attrs[a.Key] = a.Value.String()
		return true
	})
	root := c.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	root.records = append(root.records, rec)
	return nil
}

func (c *captured) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &captured{attrs: append(append([]slog.Attr{}, c.attrs...), attrs...), parent: c.root()}
}

// WithGroup keeps the handler: the records of these tests are not grouped.
func (c *captured) WithGroup(string) slog.Handler { return c }

func (c *captured) root() *captured {
	if c.parent != nil {
		return c.parent
	}
	return c
}

// deadLetterReason is the reason of a dead-letter log record naming the
// record at (its partition and offset, and its topic where given), or ""
// while there is none.
func (c *captured) deadLetterReason(at servicetest.Produced) string {
	root := c.root()
	root.mu.Lock()
	defer root.mu.Unlock()
	for _, r := range root.records {
		if !strings.Contains(r.msg, "dead-lettered") || r.attrs["partition"] != strconv.Itoa(at.Partition) ||
			r.attrs["offset"] != strconv.FormatInt(at.Offset, 10) {
			continue
		}
		if topic, ok := r.attrs["topic"]; ok && topic != at.Topic {
			continue
		}
		if reason := r.attrs["reason"]; reason != "" {
			return reason
		}
	}
	return ""
}
