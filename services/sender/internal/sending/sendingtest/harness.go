package sendingtest

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// Worker runs records of kvmesh.save.tasks through a real
// sending.Processor over an in-memory Ledger, Store and gpuworker, as
// rivertest.Worker runs one job through a river worker: Work hands back
// what the handling recorded. A Worker is used by one test goroutine.
type Worker struct {
	// Model and Keys are the processor's.
	Model *kvcore.Model
	Keys  kvcore.KeyBuilder
	// Ledger, Store, GPU and Workers are the in-memory parts it runs over.
	Ledger  *Ledger
	Store   *Store
	GPU     *GPUWorker
	Workers *Workers
	// Processor is the real processor under test.
	Processor *sending.Processor
	// Registry holds the processor's metrics (Counter reads them).
	Registry *prometheus.Registry
	// Now is the processor's clock.
	Now time.Time

	offset int64
}

// Result is what one record's handling left.
type Result struct {
	// Err is the handler's error when it was not permanent (a transient
	// failure: the consumer delivers the record again); nil when handled.
	Err error
	// Reason is the reason code of a permanent failure, which the record
	// was handed to the processor's DeadLetter for ("" for none).
	Reason kvcore.Reason
	// Outcome is the task's recorded outcome, if any (possibly recorded by
	// an earlier delivery).
	Outcome *ledger.Outcome
	// DeadLetters and Messages are the rows and outbox messages this
	// record added (transfer results, KV events, DLQ messages).
	DeadLetters []deadletter.DeadLetter
	Messages    []bus.Message
}

// Status is the outcome's task status ("" without an outcome).
func (r Result) Status() string {
	if r.Outcome == nil {
		return ""
	}
	return r.Outcome.Result.Status
}

// Group returns the outcome of group g.
func (r Result) Group(g int) (contract.GroupOutcome, bool) {
	if r.Outcome != nil {
		for _, o := range r.Outcome.Result.Groups {
			if o.Group == g {
				return o, true
			}
		}
	}
	return contract.GroupOutcome{}, false
}

// On returns the messages of topic.
func (r Result) On(topic string) []bus.Message {
	var out []bus.Message
	for _, m := range r.Messages {
		if m.Topic == topic {
			out = append(out, m)
		}
	}
	return out
}

// NewWorker returns a harness for model m, its processor built with
// retries a millisecond apart (three attempts) and then opts applied.
func NewWorker(t testing.TB, m *kvcore.Model, opts ...func(*sending.Options)) *Worker {
	t.Helper()
	w := &Worker{Model: m, Keys: kvcore.KeysOf(m), Store: NewStore(), Now: time.Unix(1_800_000_000, 0)}
	w.Ledger = NewLedger(func() time.Time { return w.Now })
	w.GPU = &GPUWorker{Store: w.Store}
	w.Workers = &Workers{Model: m, GPU: w.GPU}
	w.Registry = prometheus.NewRegistry()
	metrics, err := sending.NewMetrics(w.Registry)
	if err != nil {
		t.Fatal(err)
	}
	o := sending.Options{
		Model: m, Keys: w.Keys, Store: w.Store, Workers: w.Workers, Ledger: w.Ledger, Metrics: metrics,
		Retry: sendpolicy.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: time.Millisecond},
		Now:   func() time.Time { return w.Now },
	}
	for _, opt := range opts {
		opt(&o)
	}
	if w.Processor, err = sending.New(o); err != nil {
		t.Fatal(err)
	}
	return w
}

// Record wraps value as the next record of kvmesh.save.tasks (keyed by
// key, the request id).
func (w *Worker) Record(key string, value []byte) bus.Received {
	w.offset++
	return bus.Received{Message: bus.Message{Topic: contract.TopicSaveTasks, Key: key, Value: value},
		Partition: 0, Offset: w.offset, Time: w.Now}
}

// Work encodes task as the next record and handles it (WorkRecord).
func (w *Worker) Work(ctx context.Context, t testing.TB, task *kvcore.SaveTask) Result {
	t.Helper()
	b, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	return w.WorkRecord(ctx, t, w.Record(task.RequestID, b))
}

// WorkRecord handles rec as the consumer loop does once: Handle, and for
// a permanent failure the processor's DeadLetter with its reason. A
// transient failure is returned in Result.Err (deliver rec again to retry
// it); a failure to dead-letter fails the test.
func (w *Worker) WorkRecord(ctx context.Context, t testing.TB, rec bus.Received) Result {
	t.Helper()
	before := w.Ledger.mark()
	var r Result
	err := w.Processor.Handle(ctx, rec)
	var pe *bus.PermanentError
	if errors.As(err, &pe) {
		r.Reason = pe.Reason
		if err := w.Processor.DeadLetter(ctx, rec, pe.Reason, pe.Err); err != nil {
			t.Fatalf("DeadLetter: %v", err)
		}
		err = nil
	}
	r.Err = err
	r.DeadLetters, r.Messages = w.Ledger.since(before)
	var ids struct {
		TaskID string `json:"task_id"`
	}
	if json.Unmarshal(rec.Value, &ids) == nil && ids.TaskID != "" {
		if o, ok := w.Ledger.Outcome(ids.TaskID); ok {
			r.Outcome = &o
		}
	}
	return r
}

// Counter is the value of counter name on g, summed over its series whose
// labels include labels (name=value pairs; none: every series).
func Counter(t testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool {
					return l.GetName() == labels[i] && l.GetValue() == labels[i+1]
				}) {
					continue series
				}
			}
			sum += m.GetCounter().GetValue()
		}
		return sum
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// KeysOf lists the store keys of group g of task for rank, in chunk order.
func (w *Worker) KeysOf(t testing.TB, task *kvcore.SaveTask, g int, rank kvcore.Rank) []string {
	t.Helper()
	items, err := kvcore.PlanSend(w.Model, w.Keys, task, g, rank)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.Key
	}
	return out
}

// SaveTask builds a valid save task of model m for tokens [start, end) of
// request id on engine e1, with block ids base+i in every group and
// tokens derived from id.
func SaveTask(m *kvcore.Model, id string, start, end int, base kvcore.BlockID) *kvcore.SaveTask {
	tokens := make([]uint32, end)
	for i := range tokens {
		tokens[i] = uint32(len(id)*7919 + int(id[len(id)-1])*31 + i)
	}
	var hashes []string
	for _, h := range kvcore.HashChain(tokens, m.HashBlockSize, nil) {
		hashes = append(hashes, h.Hex())
	}
	table := make(kvcore.BlockTable, len(m.Groups))
	for g := range table {
		for i := 0; i < end/m.Groups[g].BlockSize; i++ {
			table[g] = append(table[g], base+kvcore.BlockID(i))
		}
	}
	return &kvcore.SaveTask{Schema: kvcore.SchemaSaveTask, TaskID: "task-" + id, EngineID: "e1", RequestID: id,
		Model: m.Name, Start: start, End: end, BlockTable: table, BlockHashes: hashes, Groups: m.SaveGroups(start, end)}
}
