package bus_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// delivery is one handler call.
type delivery struct {
	member    string
	key       string
	value     string
	partition int
	offset    int64
}

func recordTo(l *seen[delivery], member string) bus.Handler {
	return func(_ context.Context, m bus.Received) error {
		l.add(delivery{member: member, key: m.Key, value: string(m.Value), partition: m.Partition, offset: m.Offset})
		return nil
	}
}

func batch(topic, prefix string, n int) []bus.Message {
	msgs := make([]bus.Message, n)
	for i := range msgs {
		key := fmt.Sprintf("%s-%d", prefix, i)
		msgs[i] = bus.Message{Topic: topic, Key: key, Value: []byte(key)}
	}
	return msgs
}

func TestGroupSharesPartitionsAndResumesFromCommits(t *testing.T) {
	const topic, group = "bus.test.group", "group-share"
	e := newEnv(t)
	e.topics(topic)
	p := e.producer()

	var got seen[delivery]
	stopA := e.run(e.consumerConfig(group, topic), recordTo(&got, "a"))
	stopB := e.run(e.consumerConfig(group, topic), recordTo(&got, "b"))
	e.waitStable(group, 2)

	e.publish(p, batch(topic, "first", 40)...)
	eventually(t, "40 deliveries", func() bool { return got.len() >= 40 })
	stopA()
	stopB()

	perMember := map[string]int{}
	keys := map[string]bool{}
	for _, d := range got.snapshot() {
		if keys[d.key] {
			t.Errorf("record %s delivered twice", d.key)
		}
		keys[d.key] = true
		perMember[d.member]++
	}
	if len(keys) != 40 {
		t.Fatalf("delivered %d distinct records, want 40", len(keys))
	}
	if perMember["a"] == 0 || perMember["b"] == 0 {
		t.Fatalf("deliveries per member = %v, want both members to share the partitions", perMember)
	}

	// A new member resumes at the committed offsets: it sees only new records.
	e.publish(p, batch(topic, "second", 40)...)
	var later seen[delivery]
	e.run(e.consumerConfig(group, topic), recordTo(&later, "c"))
	eventually(t, "the second batch", func() bool { return later.len() >= 40 })
	partitions := map[int]bool{}
	for _, d := range later.snapshot() {
		if !strings.HasPrefix(d.key, "second-") {
			t.Errorf("new member saw already committed record %s", d.key)
		}
		partitions[d.partition] = true
	}
	// Each partition's second-batch records come after its first-batch ones,
	// so once every partition delivered them no committed record can follow.
	if len(partitions) != 4 {
		t.Fatalf("second batch covered partitions %v, want all 4 for this check", partitions)
	}
}

func TestTransientFailureIsRetriedThenCommitted(t *testing.T) {
	for _, sync := range []bool{false, true} {
		t.Run("sync="+strconv.FormatBool(sync), func(t *testing.T) {
			const topic, group = "bus.test.transient", "transient"
			e := newEnv(t)
			e.topics(topic)
			var calls seen[delivery]
			failures := 0
			handler := func(_ context.Context, m bus.Received) error {
				calls.add(delivery{value: string(m.Value), partition: m.Partition, offset: m.Offset})
				if string(m.Value) == "first" && failures < 2 {
					failures++
					return bus.Transient(errors.New("store busy"))
				}
				return nil
			}
			cfg := e.consumerConfig(group, topic)
			cfg.SyncCommit = sync
			stop := e.run(cfg, handler)

			e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: []byte("first")},
				bus.Message{Topic: topic, Key: "k", Value: []byte("second")})
			eventually(t, "the second record", func() bool { return calls.len() >= 4 })
			stop()

			var order []string
			for _, c := range calls.snapshot() {
				order = append(order, c.value)
			}
			if want := "first first first second"; strings.Join(order, " ") != want {
				t.Fatalf("handler calls = %v, want %s", order, want)
			}
			part := calls.snapshot()[0].partition
			if off := e.committed(group, topic, part); off != 2 {
				t.Fatalf("committed offset = %d, want 2", off)
			}
		})
	}
}

func TestStopDuringRetryLeavesRecordUncommitted(t *testing.T) {
	for _, sync := range []bool{false, true} {
		t.Run("sync="+strconv.FormatBool(sync), func(t *testing.T) {
			const topic, group = "bus.test.stop", "stop"
			e := newEnv(t)
			e.topics(topic)
			var calls seen[delivery]
			failing := func(_ context.Context, m bus.Received) error {
				calls.add(delivery{partition: m.Partition, offset: m.Offset})
				return bus.Transient(errors.New("store down"))
			}
			cfg := e.consumerConfig(group, topic)
			cfg.SyncCommit = sync
			cfg.Retry.MaxAttempts = 1000
			stop := e.run(cfg, failing)

			e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: []byte("v")})
			eventually(t, "two failed attempts", func() bool { return calls.len() >= 2 })
			stop()
			part := calls.snapshot()[0].partition
			if off := e.committed(group, topic, part); off != -1 {
				t.Fatalf("committed offset after stop mid-retry = %d, want none", off)
			}

			var again seen[delivery]
			e.run(cfg, recordTo(&again, "next"))
			eventually(t, "redelivery", func() bool { return again.len() >= 1 })
			if d := again.snapshot()[0]; d.value != "v" || d.offset != 0 {
				t.Fatalf("redelivered %+v, want the same record at offset 0", d)
			}
		})
	}
}

func TestFailedRecordsAreDeadLettered(t *testing.T) {
	boom := errors.New("bad json")
	tests := []struct {
		name         string
		fail         func() error
		wantReason   string
		wantText     string
		wantAttempts int
		wantOutcomes string
	}{
		{"undecodable", func() error { return bus.Permanent(kvcore.ReasonUndecodable, boom) }, "undecodable", "bad json", 1, "failed ok"},
		{"panic", func() error { panic("index out of range") }, "handler_panic", "index out of range", 1, "failed ok"},
		{"retries exhausted", func() error { return bus.Transient(boom) }, "retries_exhausted", "bad json", 3, "retry retry failed ok"},
		{"unclassified error", func() error { return boom }, "retries_exhausted", "bad json", 3, "retry retry failed ok"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topic, dlq, group := fmt.Sprintf("bus.test.poison%d", i), fmt.Sprintf("bus.test.dlq%d", i), fmt.Sprintf("poison%d", i)
			e := newEnv(t)
			e.topics(topic, dlq)
			var attempts, good atomic.Int32
			handler := func(_ context.Context, m bus.Received) error {
				if string(m.Value) == "poison" {
					attempts.Add(1)
					return tt.fail()
				}
				good.Add(1)
				return nil
			}
			var outcomes seen[string]
			var hookReasons seen[string]
			cfg := e.consumerConfig(group, topic)
			cfg.DLQTopic = dlq
			cfg.Hooks.Handled = func(_ string, o bus.Outcome, _ time.Duration) { outcomes.add(string(o)) }
			cfg.OnDeadLetter = func(_ context.Context, m bus.Received, reason kvcore.Reason, _ error) error {
				hookReasons.add(string(reason) + "@" + strconv.FormatInt(m.Offset, 10))
				return nil
			}
			stop := e.run(cfg, handler)

			e.publish(e.producer(),
				bus.Message{Topic: topic, Key: "req-1", Value: []byte("poison"), Headers: map[string]string{"x-origin": "test"}},
				bus.Message{Topic: topic, Key: "req-1", Value: []byte("good")})
			eventually(t, "the record after the poison one", func() bool { return good.Load() == 1 })

			dead := e.readAll(dlq, 1)[0]
			h := map[string]string{}
			for _, kv := range dead.Headers {
				h[kv.Key] = string(kv.Value)
			}
			if string(dead.Key) != "req-1" || string(dead.Value) != "poison" {
				t.Errorf("dead letter %s=%s, want the original key and value", dead.Key, dead.Value)
			}
			if h[contract.HeaderReason] != tt.wantReason || !strings.Contains(h[contract.HeaderReasonText], tt.wantText) {
				t.Errorf("reason headers = %q / %q, want %q / containing %q",
					h[contract.HeaderReason], h[contract.HeaderReasonText], tt.wantReason, tt.wantText)
			}
			stop()
			if h[contract.HeaderOrigTopic] != topic || h[contract.HeaderOrigOffset] != "0" || h["x-origin"] != "test" {
				t.Errorf("origin headers = %v, want topic %s, offset 0 and the original headers", h, topic)
			}
			if got := int(attempts.Load()); got != tt.wantAttempts {
				t.Errorf("poison record handled %d times, want %d", got, tt.wantAttempts)
			}
			if got := strings.Join(outcomes.snapshot(), " "); got != tt.wantOutcomes {
				t.Errorf("outcomes = %q, want %q", got, tt.wantOutcomes)
			}
			if got := hookReasons.snapshot(); len(got) != 1 || got[0] != tt.wantReason+"@0" {
				t.Errorf("OnDeadLetter calls = %v, want one with %s at offset 0", got, tt.wantReason)
			}
			origPart, err := strconv.Atoi(h[contract.HeaderOrigPart])
			if err != nil {
				t.Fatalf("bad %s header %q", contract.HeaderOrigPart, h[contract.HeaderOrigPart])
			}
			if off := e.committed(group, topic, origPart); off != 2 {
				t.Errorf("committed offset of partition %d = %d, want 2 (past the poison and the good record)", origPart, off)
			}
		})
	}
}

// TestGroupSpreadsPartitionsOfSeveralTopics runs more members than one
// topic has partitions over two topics: every member gets a partition
// (round robin over all partitions, not range per topic, which would give
// both topics' partitions to the same two members).
func TestGroupSpreadsPartitionsOfSeveralTopics(t *testing.T) {
	const group = "group-spread"
	topics := []string{"bus.test.spread-a", "bus.test.spread-b"}
	e := newEnv(t)
	e.topicsWith(2, topics...)
	for range 4 {
		e.run(e.consumerConfig(group, topics...), func(context.Context, bus.Received) error { return nil })
	}
	e.waitStable(group, 4)
}
