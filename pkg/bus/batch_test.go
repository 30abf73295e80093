package bus_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// batchConfig is consumerConfig for a batch consumer whose batches stay
// open long enough for every pre-produced record to join.
func (e *env) batchConfig(group string, topics ...string) bus.ConsumerConfig {
	cfg := e.consumerConfig(group, topics...)
	cfg.BatchLinger = 200 * time.Millisecond
	return cfg
}

// values returns the values of recs.
func values(recs []bus.Received) []string {
	out := make([]string, len(recs))
	for i, r := range recs {
		out[i] = string(r.Value)
	}
	return out
}

// deadLetterLog records the OnDeadLetter calls as "value:reason".
func deadLetterLog(l *seen[string]) bus.DeadLetterFunc {
	return func(_ context.Context, m bus.Received, reason kvcore.Reason, _ error) error {
		l.add(string(m.Value) + ":" + string(reason))
		return nil
	}
}

// partitionCounts counts deliveries per partition.
func partitionCounts(ds []delivery) map[int]int {
	out := map[int]int{}
	for _, d := range ds {
		out[d.partition]++
	}
	return out
}

func TestBatchesFormKeepPartitionOrderAndCommit(t *testing.T) {
	const topic, group, n = "bus.test.batch", "batch", 500
	e := newEnv(t)
	e.topics(topic)
	p := e.producer()
	e.publish(p, batch(topic, "rec", n)...)

	var got seen[delivery]
	var sizes seen[int]
	cfg := e.consumerConfig(group, topic) // the default linger
	cfg.BatchSize = 64
	stop := e.runBatch(cfg, func(_ context.Context, recs []bus.Received) error {
		sizes.add(len(recs))
		for _, m := range recs {
			got.add(delivery{key: m.Key, partition: m.Partition, offset: m.Offset})
		}
		return nil
	})
	eventually(t, "all records", func() bool { return got.len() >= n })
	stop()

	calls := sizes.snapshot()
	t.Logf("%d records in %d batches", n, len(calls))
	if len(calls) > n/10 {
		t.Errorf("%d records took %d handler calls, want at most %d (batches of %v)", n, len(calls), n/10, calls)
	}
	if m := slices.Max(calls); m > 64 {
		t.Errorf("a batch of %d records, want at most BatchSize 64", m)
	}
	last := map[int]int64{}
	keys := map[string]bool{}
	for _, d := range got.snapshot() {
		if prev, ok := last[d.partition]; ok && d.offset <= prev {
			t.Errorf("partition %d: offset %d handled after %d", d.partition, d.offset, prev)
		}
		last[d.partition] = d.offset
		if keys[d.key] {
			t.Errorf("record %s handled twice", d.key)
		}
		keys[d.key] = true
	}
	if len(keys) != n {
		t.Fatalf("handled %d distinct records, want %d", len(keys), n)
	}
	counts := partitionCounts(got.snapshot())
	for part, c := range counts {
		if off := e.committed(group, topic, part); off != int64(c) {
			t.Errorf("partition %d: committed offset %d, want %d", part, off, c)
		}
	}

	// A new member of the group sees only a record published after the stop.
	var later seen[delivery]
	e.run(e.consumerConfig(group, topic), recordTo(&later, "next"))
	e.publish(p, bus.Message{Topic: topic, Key: "after", Value: []byte("after")})
	eventually(t, "the record published after the stop", func() bool { return later.len() >= 1 })
	if d := later.snapshot(); len(d) != 1 || d[0].key != "after" {
		t.Fatalf("the next member handled %+v, want only the new record", d)
	}
}

func TestBatchRecordErrorsDeadLetterOnlyTheListedRecords(t *testing.T) {
	const topic, group = "bus.test.batch-errors", "batch-errors"
	e := newEnv(t)
	e.topicsWith(1, topic)
	vals := []string{"ok-0", "permanent", "ok-1", "transient-once", "ok-2", "transient-always", "ok-3"}
	msgs := make([]bus.Message, len(vals))
	for i, v := range vals {
		msgs[i] = bus.Message{Topic: topic, Key: v, Value: []byte(v)}
	}
	e.publish(e.producer(), msgs...)

	var applied, calls, deadLetters seen[string]
	var outcomes seen[string]
	var dlHooks atomic.Int32
	cfg := e.batchConfig(group, topic)
	cfg.OnDeadLetter = deadLetterLog(&deadLetters)
	cfg.Hooks.Handled = func(_ string, o bus.Outcome, _ time.Duration) { outcomes.add(string(o)) }
	cfg.Hooks.DeadLettered = func(string, kvcore.Reason) { dlHooks.Add(1) }
	stop := e.runBatch(cfg, func(_ context.Context, recs []bus.Received) error {
		calls.add(strings.Join(values(recs), ","))
		alone := len(recs) == 1
		errs := bus.RecordErrors{}
		for i, m := range recs {
			switch v := string(m.Value); {
			case v == "permanent":
				errs[i] = bus.Permanent("bad_record", errors.New("cannot apply"))
			case v == "transient-always", v == "transient-once" && !alone:
				errs[i] = bus.Transient(errors.New("busy"))
			default:
				applied.add(v)
			}
		}
		return errs
	})
	eventually(t, "both dead letters", func() bool { return deadLetters.len() >= 2 })
	eventually(t, "the committed offset past the batch", func() bool { return e.committed(group, topic, 0) == int64(len(vals)) })
	stop()

	c := calls.snapshot()
	if len(c) == 0 || c[0] != strings.Join(vals, ",") {
		t.Fatalf("first handler call got %v, want the whole batch %v", c, vals)
	}
	want := []string{strings.Join(vals, ","), "transient-once", "transient-always", "transient-always", "transient-always"}
	if !slices.Equal(c, want) {
		t.Errorf("handler calls %q, want %q", c, want)
	}
	if got, want := applied.snapshot(), []string{"ok-0", "ok-1", "ok-2", "ok-3", "transient-once"}; !slices.Equal(got, want) {
		t.Errorf("applied %v, want %v", got, want)
	}
	if got, want := deadLetters.snapshot(), []string{"permanent:bad_record", "transient-always:retries_exhausted"}; !slices.Equal(got, want) {
		t.Errorf("dead letters %v, want %v", got, want)
	}
	if n := dlHooks.Load(); n != 2 {
		t.Errorf("DeadLettered hook called %d times, want 2", n)
	}
	// The batch: 5 ok, 1 failed, 2 retry; then transient-once ok, then
	// transient-always retry, retry, failed.
	if got, want := strings.Join(outcomes.snapshot(), " "), "ok failed ok retry ok retry ok ok retry retry failed"; got != want {
		t.Errorf("outcomes %q, want %q", got, want)
	}
	reasons := map[string]string{}
	for _, d := range e.readAll(dlqTopic, 2) {
		for _, kv := range d.Headers {
			if kv.Key == contract.HeaderReason {
				reasons[string(d.Value)] = string(kv.Value)
			}
		}
	}
	if want := map[string]string{"permanent": "bad_record", "transient-always": "retries_exhausted"}; !maps.Equal(reasons, want) {
		t.Errorf("DLQ records' reasons %v, want %v", reasons, want)
	}
}

func TestBatchPoisonRecordIsIsolated(t *testing.T) {
	tests := []struct {
		name         string
		fail         func() error
		wantReason   string
		wantAttempts int // calls whose batch holds the poison record
	}{
		// 3 attempts of the batch, then 3 of the poison record alone.
		{"transient", func() error { return bus.Transient(errors.New("store busy")) }, "retries_exhausted", 6},
		{"permanent", func() error { return bus.Permanent(kvcore.ReasonUndecodable, errors.New("bad json")) }, "undecodable", 2},
		{"panic", func() error { panic("nil map") }, "handler_panic", 2},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topic, group := fmt.Sprintf("bus.test.batch-poison%d", i), fmt.Sprintf("batch-poison%d", i)
			const n, poison = 40, 17
			e := newEnv(t)
			e.topicsWith(1, topic)
			msgs := batch(topic, "rec", n)
			msgs[poison].Value = []byte("poison")
			e.publish(e.producer(), msgs...)

			var applied seen[int64]
			var deadLetters seen[string]
			var poisonCalls seen[int]
			cfg := e.batchConfig(group, topic)
			cfg.OnDeadLetter = deadLetterLog(&deadLetters)
			e.runBatch(cfg, func(_ context.Context, recs []bus.Received) error {
				for _, m := range recs {
					if string(m.Value) == "poison" {
						poisonCalls.add(len(recs))
						return tt.fail()
					}
				}
				for _, m := range recs {
					applied.add(m.Offset)
				}
				return nil
			})
			eventually(t, "the committed offset past every record", func() bool { return e.committed(group, topic, 0) == n })

			pc := poisonCalls.snapshot()
			if len(pc) == 0 || pc[0] < 2 {
				t.Fatalf("batches holding the poison record had sizes %v; the test needs it in a batch of several", pc)
			}
			if len(pc) != tt.wantAttempts || pc[len(pc)-1] != 1 {
				t.Errorf("calls with the poison record had batch sizes %v, want %d calls ending alone", pc, tt.wantAttempts)
			}
			var want []int64
			for off := range int64(n) {
				if off != poison {
					want = append(want, off)
				}
			}
			if got := applied.snapshot(); !slices.Equal(got, want) {
				t.Errorf("applied offsets %v, want every offset but %d, once each, in order", got, poison)
			}
			if got := deadLetters.snapshot(); len(got) != 1 || got[0] != "poison:"+tt.wantReason {
				t.Errorf("dead letters %v, want only the poison record with %s", got, tt.wantReason)
			}
		})
	}
}

func TestBatchTransientFailureIsRetriedWhole(t *testing.T) {
	const topic, group, n = "bus.test.batch-retry", "batch-retry", 10
	e := newEnv(t)
	e.topicsWith(1, topic)
	e.publish(e.producer(), batch(topic, "rec", n)...)

	var calls seen[string]
	var applied atomic.Int32
	cfg := e.batchConfig(group, topic)
	stop := e.runBatch(cfg, func(_ context.Context, recs []bus.Received) error {
		calls.add(strings.Join(values(recs), ","))
		if calls.len() <= 2 {
			return errors.New("database restarting")
		}
		applied.Add(int32(len(recs)))
		return nil
	})
	eventually(t, "the committed offset past the batch", func() bool { return e.committed(group, topic, 0) == n })
	stop()

	c := calls.snapshot()
	if len(c) != 3 || c[0] != c[1] || c[1] != c[2] || strings.Count(c[0], ",") != n-1 {
		t.Fatalf("handler calls %q, want the same batch of %d three times", c, n)
	}
	if got := applied.Load(); got != n {
		t.Errorf("applied %d records, want %d", got, n)
	}
}

func TestBatchStopMidBatchCommitsNothing(t *testing.T) {
	const topic, group, n = "bus.test.batch-stop", "batch-stop", 10
	e := newEnv(t)
	e.topicsWith(1, topic)
	e.publish(e.producer(), batch(topic, "rec", n)...)

	var sizes seen[int]
	stop := e.runBatch(e.batchConfig(group, topic), func(ctx context.Context, recs []bus.Received) error {
		sizes.add(len(recs))
		<-ctx.Done()
		return ctx.Err()
	})
	eventually(t, "the handler to hold a batch", func() bool { return sizes.len() >= 1 })
	stop()
	if off := e.committed(group, topic, 0); off != -1 {
		t.Fatalf("committed offset %d after a stop mid-batch, want none", off)
	}
	if s := sizes.snapshot(); len(s) != 1 || s[0] < 2 {
		t.Errorf("batch sizes %v, want one batch of several records", s)
	}

	var again seen[delivery]
	e.run(e.consumerConfig(group, topic), recordTo(&again, "next"))
	eventually(t, "every record again", func() bool { return again.len() >= n })
	for i, d := range again.snapshot() {
		if d.offset != int64(i) {
			t.Fatalf("redelivery %d at offset %d, want %d", i, d.offset, i)
		}
	}
}

func TestBatchOfOneUnwrapsRecordErrors(t *testing.T) {
	tests := []struct {
		name       string
		answer     error
		wantReason string // "" : handled without a dead letter
	}{
		{"empty", bus.RecordErrors{}, ""},
		{"nil entry", bus.RecordErrors{0: nil}, ""},
		{"permanent", bus.RecordErrors{0: bus.Permanent("bad_record", errors.New("x"))}, "bad_record"},
		{"wrapped permanent", fmt.Errorf("apply: %w", bus.RecordErrors{0: bus.Permanent("bad_record", nil)}), "bad_record"},
		{"index outside the batch", bus.RecordErrors{3: bus.Permanent("bad_record", nil)}, "retries_exhausted"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topic, group := "bus.test.batch-one"+strconv.Itoa(i), "batch-one"+strconv.Itoa(i)
			e := newEnv(t)
			e.topicsWith(1, topic)
			var deadLetters seen[string]
			var calls atomic.Int32
			cfg := e.consumerConfig(group, topic)
			cfg.OnDeadLetter = deadLetterLog(&deadLetters)
			e.runBatch(cfg, func(_ context.Context, recs []bus.Received) error {
				calls.Add(1)
				return tt.answer
			})
			e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: []byte("v")})
			eventually(t, "the record committed", func() bool { return e.committed(group, topic, 0) == 1 })
			var want []string
			if tt.wantReason != "" {
				want = []string{"v:" + tt.wantReason}
			}
			if got := deadLetters.snapshot(); !slices.Equal(got, want) {
				t.Errorf("dead letters %v, want %v (after %d calls)", got, want, calls.Load())
			}
		})
	}
}
