package sending_test

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending/sendingtest"
)

// These tests run save tasks through the real Processor.Handle over the
// in-memory parts of sendingtest: they need no PostgreSQL, Redis or Kafka.

func TestHandleSaveTask(t *testing.T) {
	cases := []struct {
		name    string
		mutate  func(*kvcore.SaveTask)
		arrange func(*sendingtest.Worker)
		// want is every group's outcome; wantStatus the task's.
		want       []contract.GroupOutcome
		wantStatus string
		// wantDL is the reason and group of each dead letter, in order.
		wantDL      []deadLetterWant
		wantChecks  int // existence checks made
		wantEvents  int // BlockStored records published
		wantStored  int // keys in the store afterwards
		wantForgets int // failed put attempts
	}{
		{
			name:       "good save: every group stored",
			want:       []contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, Stored: 1}},
			wantStatus: "stored", wantChecks: 1, wantEvents: 2, wantStored: 3,
		},
		{
			name:       "malformed group dead-lettered with its reason, the other stored",
			mutate:     func(task *kvcore.SaveTask) { task.BlockTable[1][1] = kvcore.NullBlock },
			want:       []contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, DeadLettered: 1, Reason: "null_block"}},
			wantStatus: "dead_lettered", wantDL: []deadLetterWant{{"null_block", 1}},
			wantChecks: 1, wantEvents: 1, wantStored: 2,
		},
		{
			name:       "transient store failure retried, then stored",
			arrange:    func(w *sendingtest.Worker) { w.Store.FailExists(2) },
			want:       []contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, Stored: 1}},
			wantStatus: "stored", wantChecks: 3, wantEvents: 2, wantStored: 3,
		},
		{
			name:       "store failing through every retry: dead-lettered exists_failed per group",
			arrange:    func(w *sendingtest.Worker) { w.Store.FailExists(10) },
			want:       []contract.GroupOutcome{{Group: 0, DeadLettered: 2, Reason: "exists_failed"}, {Group: 1, DeadLettered: 1, Reason: "exists_failed"}},
			wantStatus: "dead_lettered", wantDL: []deadLetterWant{{"exists_failed", 0}, {"exists_failed", 1}},
			wantChecks: 3,
		},
		{
			name:       "worker down twice: retried, then stored",
			arrange:    func(w *sendingtest.Worker) { w.GPU.Down(2) },
			want:       []contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, Stored: 1}},
			wantStatus: "stored", wantChecks: 1, wantEvents: 2, wantStored: 3, wantForgets: 2,
		},
		{
			name:       "worker down through every retry: failed and dead-lettered put_failed",
			arrange:    func(w *sendingtest.Worker) { w.GPU.Down(10) },
			want:       []contract.GroupOutcome{{Group: 0, Failed: 2, Reason: "put_failed"}, {Group: 1, Failed: 1, Reason: "put_failed"}},
			wantStatus: "failed", wantDL: []deadLetterWant{{"put_failed", 0}, {"put_failed", 1}},
			wantChecks: 1, wantForgets: 3,
		},
		{
			name:       "worker rejects the request: failed, not retried, no dead letter",
			arrange:    func(w *sendingtest.Worker) { w.GPU.Reject() },
			want:       []contract.GroupOutcome{{Group: 0, Failed: 2, Reason: "put_failed"}, {Group: 1, Failed: 1, Reason: "put_failed"}},
			wantStatus: "failed", wantChecks: 1, wantForgets: 1,
		},
		{
			name: "keys already present are not put again",
			arrange: func(w *sendingtest.Worker) {
				w.Store.Add(w.KeysOf(t, sendingtest.SaveTask(w.Model, "r", 0, 32, 0), 0, kvcore.Rank{})...)
			},
			want:       []contract.GroupOutcome{{Group: 0, Existing: 2}, {Group: 1, Stored: 1}},
			wantStatus: "stored", wantChecks: 1, wantEvents: 1, wantStored: 3,
		},
		{
			name: "block no longer holding its chunk: its group dead-lettered block_not_held",
			arrange: func(w *sendingtest.Worker) {
				w.GPU.AnswerBlock(dataplane.BlockRef{Group: 0, Block: 1}, dataplane.PutNotHeld)
			},
			want:       []contract.GroupOutcome{{Group: 0, Stored: 1, DeadLettered: 1, Reason: "block_not_held"}, {Group: 1, Stored: 1}},
			wantStatus: "dead_lettered", wantDL: []deadLetterWant{{"block_not_held", 0}},
			wantChecks: 1, wantEvents: 2, wantStored: 2,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := sendingtest.NewWorker(t, mustModel(t))
			task := sendingtest.SaveTask(w.Model, "r", 0, 32, 0)
			if tc.mutate != nil {
				tc.mutate(task)
			}
			if tc.arrange != nil {
				tc.arrange(w)
			}
			r := w.Work(context.Background(), t, task)
			if r.Err != nil || r.Reason != "" {
				t.Fatalf("Work: err %v, reason %q", r.Err, r.Reason)
			}
			if r.Status() != tc.wantStatus || !equalGroups(r.Outcome.Result.Groups, tc.want) {
				t.Fatalf("outcome %+v, want %s %+v", r.Outcome, tc.wantStatus, tc.want)
			}
			checkDeadLetters(t, r, task, tc.wantDL)
			if n := len(r.On(contract.TopicTransferResults)); n != 1 {
				t.Errorf("%d transfer results, want 1", n)
			}
			if n := len(r.On(contract.TopicKVEvents)); n != tc.wantEvents {
				t.Errorf("%d BlockStored records, want %d", n, tc.wantEvents)
			}
			if n := w.Store.Checks(); n != tc.wantChecks {
				t.Errorf("%d existence checks, want %d", n, tc.wantChecks)
			}
			if n := len(w.Store.Keys()); n != tc.wantStored {
				t.Errorf("%d keys in the store, want %d", n, tc.wantStored)
			}
			if n := w.Workers.Forgotten(); n != tc.wantForgets {
				t.Errorf("%d failed put attempts, want %d", n, tc.wantForgets)
			}
		})
	}
}

type deadLetterWant struct {
	reason kvcore.Reason
	group  int
}

// checkDeadLetters checks the record's dead letters against want and that
// each went out on the DLQ topic with the record's payload.
func checkDeadLetters(t *testing.T, r sendingtest.Result, task *kvcore.SaveTask, want []deadLetterWant) {
	t.Helper()
	if len(r.DeadLetters) != len(want) {
		t.Fatalf("dead letters %+v, want %+v", r.DeadLetters, want)
	}
	for i, d := range r.DeadLetters {
		if d.Reason != want[i].reason || d.Group == nil || *d.Group != want[i].group || d.TaskID != task.TaskID ||
			len(d.Payload) == 0 || d.Topic != contract.TopicSaveTasks {
			t.Errorf("dead letter %d = %+v, want %+v", i, d, want[i])
		}
	}
	if n := len(r.On(contract.TopicSaveDLQ)); n != len(want) {
		t.Errorf("%d DLQ messages, want %d", n, len(want))
	}
}

func TestHandlePermanentFailures(t *testing.T) {
	m := mustModel(t)
	cases := []struct {
		name        string
		value       []byte
		wantOutcome string // the task's status; "" for none
		wantResults int    // transfer results published
	}{
		{"not JSON: dead-lettered whole, no outcome", []byte("not json"), "", 0},
		{"unknown field, ids readable: every group dead-lettered undecodable and reported",
			[]byte(`{"task_id":"u1","engine_id":"e1","request_id":"x","junk":1}`), "dead_lettered", 1},
		{"a task id that cannot be stored: dead-lettered whole, no outcome",
			[]byte(`{"schema":"kvmesh.save_task.v1","task_id":"a\u0000b","engine_id":"e1","request_id":"x"}`), "", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := sendingtest.NewWorker(t, m)
			rec := w.Record("x", tc.value)
			r := w.WorkRecord(context.Background(), t, rec)
			if r.Err != nil || r.Reason != kvcore.ReasonUndecodable {
				t.Fatalf("Work: err %v, reason %q; want a permanent %s", r.Err, r.Reason, kvcore.ReasonUndecodable)
			}
			if r.Status() != tc.wantOutcome {
				t.Fatalf("outcome %+v, want status %q", r.Outcome, tc.wantOutcome)
			}
			if len(r.DeadLetters) != 1 || r.DeadLetters[0].Slot != deadletter.WholeRecord || r.DeadLetters[0].Group != nil ||
				r.DeadLetters[0].Reason != kvcore.ReasonUndecodable || !bytes.Equal(r.DeadLetters[0].Payload, tc.value) {
				t.Fatalf("dead letters %+v, want one whole-record undecodable", r.DeadLetters)
			}
			if n := len(r.On(contract.TopicTransferResults)); n != tc.wantResults {
				t.Errorf("%d transfer results, want %d", n, tc.wantResults)
			}
			if n := len(r.On(contract.TopicSaveDLQ)); n != 1 {
				t.Errorf("%d DLQ messages, want 1", n)
			}
			// The consumer retries DeadLetter until it is recorded: a second
			// call adds nothing.
			if err := w.Processor.DeadLetter(context.Background(), rec, kvcore.ReasonUndecodable, errors.New("again")); err != nil {
				t.Fatal(err)
			}
			if n := len(w.Ledger.DeadLetters()); n != 1 {
				t.Errorf("%d dead letters after a second DeadLetter, want 1", n)
			}
		})
	}
}

func TestHandleLedgerFailureIsTransientAndRedeliveryCommitsOnce(t *testing.T) {
	w := sendingtest.NewWorker(t, mustModel(t))
	task := sendingtest.SaveTask(w.Model, "r", 0, 32, 0)
	w.Ledger.FailCommits(1)
	rec := w.Record(task.RequestID, encode(t, task))
	r := w.WorkRecord(context.Background(), t, rec)
	if r.Err == nil || !errors.Is(r.Err, sendingtest.ErrInjected) || r.Outcome != nil || len(r.Messages) != 0 {
		t.Fatalf("first delivery: %+v, want a transient failure recording nothing", r)
	}
	r = w.WorkRecord(context.Background(), t, rec)
	if r.Err != nil || r.Status() != "stored" || len(r.On(contract.TopicTransferResults)) != 1 {
		t.Fatalf("redelivery: %+v, want stored and reported", r)
	}
	// The keys the first delivery put are found present.
	if g, _ := r.Group(0); g.Existing != 2 || g.Stored != 0 {
		t.Errorf("group 0 on redelivery %+v, want 2 existing", g)
	}
	r = w.WorkRecord(context.Background(), t, rec)
	if r.Err != nil || len(r.Messages) != 0 || w.Ledger.Commits() != 2 {
		t.Fatalf("third delivery: %+v after %d commits, want nothing new and no commit", r, w.Ledger.Commits())
	}
}

// duplicates is the name of the sender's duplicate-task counter.
const duplicates = "kvmesh_sender_duplicate_tasks_total"

// TestTaskDeliveredTwiceToOneProcessIsSavedOnce: a task handled again by
// the process that committed it (the same record redelivered, or a second
// record of it the outbox relay published twice) is found in the
// processor's recent set: no existence check, no put, no commit, nothing
// published, counted once per delivery as a duplicate.
func TestTaskDeliveredTwiceToOneProcessIsSavedOnce(t *testing.T) {
	ctx := context.Background()
	w := sendingtest.NewWorker(t, mustModel(t))
	task := sendingtest.SaveTask(w.Model, "twice", 0, 32, 0)
	rec := w.Record(task.RequestID, encode(t, task))
	first := w.WorkRecord(ctx, t, rec)
	if first.Err != nil || first.Status() != "stored" || len(first.On(contract.TopicTransferResults)) != 1 {
		t.Fatalf("first delivery: %+v, want stored and reported", first)
	}
	checks, puts, commits := w.Store.Checks(), w.GPU.Requests(), w.Ledger.Commits()
	if puts != 1 || commits != 1 {
		t.Fatalf("first delivery: %d put requests, %d commits; want 1, 1", puts, commits)
	}
	for i, again := range []bus.Received{rec, w.Record(task.RequestID, rec.Value)} {
		r := w.WorkRecord(ctx, t, again)
		if r.Err != nil || len(r.Messages) != 0 || len(r.DeadLetters) != 0 || r.Status() != "stored" {
			t.Fatalf("delivery %d: %v, %d messages, %d dead letters, status %q; want nothing new and the first outcome kept",
				i+2, r.Err, len(r.Messages), len(r.DeadLetters), r.Status())
		}
	}
	if w.Store.Checks() != checks || w.GPU.Requests() != puts || w.Ledger.Commits() != commits {
		t.Errorf("after the duplicates: %d existence checks, %d put requests, %d commits; want %d, %d, %d",
			w.Store.Checks(), w.GPU.Requests(), w.Ledger.Commits(), checks, puts, commits)
	}
	if n := len(w.Ledger.Outbox()); n != len(first.Messages) {
		t.Errorf("%d messages in the outbox, want the first delivery's %d", n, len(first.Messages))
	}
	if n := sendingtest.Counter(t, w.Registry, duplicates); n != 2 {
		t.Errorf("%s = %v, want 2", duplicates, n)
	}
	if n := sendingtest.Counter(t, w.Registry, "kvmesh_sender_tasks_total", "status", "stored"); n != 1 {
		t.Errorf("tasks stored = %v, want 1", n)
	}
}

// TestTaskForgottenByTheRecentSetIsDroppedAtCommit: with room for one task
// id, a task redelivered after another task pushed it out is handled
// again and dropped by the commit's own dedupe: its second save, with the
// store failing every existence check, dead-letters both groups
// exists_failed, yet nothing is published and no dead letter kept, the
// first outcome stays, and it is counted a duplicate; from then on it is
// in the set again.
func TestTaskForgottenByTheRecentSetIsDroppedAtCommit(t *testing.T) {
	ctx := context.Background()
	w := sendingtest.NewWorker(t, mustModel(t), func(o *sending.Options) { o.RecentTasks = 1 })
	task := sendingtest.SaveTask(w.Model, "a", 0, 32, 0)
	rec := w.Record(task.RequestID, encode(t, task))
	if r := w.WorkRecord(ctx, t, rec); r.Err != nil || r.Status() != "stored" {
		t.Fatalf("first delivery: %+v", r)
	}
	if r := w.Work(ctx, t, sendingtest.SaveTask(w.Model, "b", 0, 32, 8)); r.Err != nil || r.Status() != "stored" {
		t.Fatalf("other task: %+v", r)
	}
	puts, commits, outbox, checks := w.GPU.Requests(), w.Ledger.Commits(), len(w.Ledger.Outbox()), w.Store.Checks()
	w.Store.FailExists(100)
	r := w.WorkRecord(ctx, t, rec)
	if r.Err != nil || len(r.Messages) != 0 || len(r.DeadLetters) != 0 || r.Status() != "stored" {
		t.Fatalf("redelivery: %v, %d messages, %d dead letters, status %q; want nothing new and the first outcome kept",
			r.Err, len(r.Messages), len(r.DeadLetters), r.Status())
	}
	if w.GPU.Requests() != puts || w.Ledger.Commits() != commits+1 || len(w.Ledger.Outbox()) != outbox {
		t.Errorf("redelivery: %d put requests, %d commits, %d messages; want %d, %d, %d",
			w.GPU.Requests(), w.Ledger.Commits(), len(w.Ledger.Outbox()), puts, commits+1, outbox)
	}
	if w.Store.Checks() == checks || len(w.Ledger.DeadLetters()) != 0 {
		t.Errorf("redelivery: %d existence checks, %d dead letters kept; want it handled, none kept", w.Store.Checks(), len(w.Ledger.DeadLetters()))
	}
	if n := sendingtest.Counter(t, w.Registry, duplicates); n != 1 {
		t.Errorf("%s = %v, want 1", duplicates, n)
	}
	if n := sendingtest.Counter(t, w.Registry, "kvmesh_dead_letters_total"); n != 0 {
		t.Errorf("dead letters counted = %v, want 0", n)
	}
	// Found done at commit, it is remembered: a third delivery costs nothing.
	if r := w.WorkRecord(ctx, t, rec); r.Err != nil || len(r.Messages) != 0 || w.Ledger.Commits() != commits+1 {
		t.Errorf("third delivery: %v, %d messages after %d commits; want nothing new and no commit", r.Err, len(r.Messages), w.Ledger.Commits())
	}
	if n := sendingtest.Counter(t, w.Registry, duplicates); n != 2 {
		t.Errorf("%s = %v, want 2", duplicates, n)
	}
}

func TestReplayWithoutDatabase(t *testing.T) {
	w := sendingtest.NewWorker(t, mustModel(t))
	task := sendingtest.SaveTask(w.Model, "r", 0, 32, 0)
	w.GPU.Down(10)
	r := w.Work(context.Background(), t, task)
	if r.Status() != "failed" || len(r.DeadLetters) != 2 {
		t.Fatalf("save %+v, want failed with two dead letters", r)
	}
	w.GPU.Down(0)
	ctx := context.Background()
	for _, d := range r.DeadLetters {
		out, err := w.Processor.Replay(ctx, d.ID)
		if err != nil || out.Already || out.DeadLetter.ReplayStatus != deadletter.ReplayDone {
			t.Fatalf("replay of %d: %+v, %v", d.ID, out, err)
		}
	}
	again, err := w.Processor.Replay(ctx, r.DeadLetters[0].ID)
	if err != nil || !again.Already {
		t.Fatalf("second replay: %+v, %v; want already replayed", again, err)
	}
	if _, err := w.Processor.Replay(ctx, 99); !errors.Is(err, deadletter.ErrNotFound) {
		t.Fatalf("replay of an unknown id: %v, want ErrNotFound", err)
	}
	if n := len(w.Store.Keys()); n != 3 {
		t.Errorf("%d keys stored after the replays, want 3", n)
	}
}
