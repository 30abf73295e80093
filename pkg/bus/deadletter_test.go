package bus_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func TestDeadLetterFailureBlocksCommit(t *testing.T) {
	tests := []struct {
		name          string
		hookFailures  int32 // how many OnDeadLetter calls fail; -1: all
		wantCommitted bool
	}{
		{"hook recovers", 2, true},
		{"hook keeps failing until stop", -1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			const topic, group = "bus.test.dlqfail", "dlqfail"
			e := newEnv(t)
			e.topics(topic)
			var hookCalls atomic.Int32
			var partition atomic.Int64
			cfg := e.consumerConfig(group, topic)
			cfg.OnDeadLetter = func(_ context.Context, m bus.Received, _ kvcore.Reason, _ error) error {
				partition.Store(int64(m.Partition))
				if n := hookCalls.Add(1); tt.hookFailures < 0 || n <= tt.hookFailures {
					return errors.New("sender database down")
				}
				return nil
			}
			poison := func(context.Context, bus.Received) error {
				return bus.Permanent(kvcore.ReasonUndecodable, errors.New("not json"))
			}
			stop := e.run(cfg, poison)
			e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: []byte("{")})

			if tt.wantCommitted {
				eventually(t, "a commit", func() bool { return e.committed(group, topic, int(partition.Load())) == 1 })
				stop()
				if got := hookCalls.Load(); got != tt.hookFailures+1 {
					t.Fatalf("OnDeadLetter called %d times, want %d", got, tt.hookFailures+1)
				}
				dead := e.readAll(dlqTopic, 1)[0]
				if string(dead.Value) != "{" {
					t.Fatalf("dead letter value %q, want the original", dead.Value)
				}
				return
			}
			eventually(t, "repeated hook failures", func() bool { return hookCalls.Load() >= 3 })
			stop()
			if off := e.committed(group, topic, int(partition.Load())); off != -1 {
				t.Fatalf("committed offset %d although dead-lettering never succeeded", off)
			}
		})
	}
}

func TestDeadLetterMessage(t *testing.T) {
	rec := bus.Received{
		Message:   bus.Message{Topic: "orig", Key: "req-9", Value: []byte("v"), Headers: map[string]string{"traceparent": "tp", "x": "y"}},
		Partition: 3,
		Offset:    41,
	}
	long := strings.Repeat("é", 1000) // 2000 bytes
	m := bus.DeadLetterMessage("dlq", rec, "bad_group", errors.New(long))
	want := map[string]string{
		"x":                   "y",
		contract.HeaderReason: "bad_group", contract.HeaderOrigTopic: "orig",
		contract.HeaderOrigPart: "3", contract.HeaderOrigOffset: "41",
		contract.HeaderPayloadBytes: "1",
	}
	for k, v := range want {
		if m.Headers[k] != v {
			t.Errorf("header %s = %q, want %q", k, m.Headers[k], v)
		}
	}
	text := m.Headers[contract.HeaderReasonText]
	if len(text) > 1024 || !utf8.ValidString(text) || !strings.HasPrefix(long, text) || text == "" {
		t.Errorf("reason text of %d bytes is not a valid UTF-8 prefix of at most 1024 bytes", len(text))
	}
	if m.Topic != "dlq" || m.Key != "req-9" || string(m.Value) != "v" {
		t.Errorf("dead letter %+v, want topic dlq with the original key and value", m)
	}
	if v, ok := m.Headers[contract.HeaderPayloadTruncated]; ok {
		t.Errorf("a 1-byte value is marked truncated (%q)", v)
	}
	if tp, ok := m.Headers[contract.HeaderTraceparent]; ok {
		t.Errorf("dead letter keeps the original traceparent %q; it must continue the consumer's trace", tp)
	}
	if _, ok := rec.Headers[contract.HeaderReason]; ok {
		t.Errorf("DeadLetterMessage modified the record's headers")
	}
}

// TestDeadLetterOfHugeRecordIsBounded: a ~900 KiB record dead-lettered by
// the consumer yields a dead letter whose value is the record's first
// contract.MaxDeadLetterPayload bytes, with headers giving the original size
// and saying it was truncated.
func TestDeadLetterOfHugeRecordIsBounded(t *testing.T) {
	const topic, group = "bus.test.huge", "huge"
	e := newEnv(t)
	e.topics(topic)
	huge := []byte(strings.Repeat("0123456789abcdef", 900<<10/16))
	poison := func(context.Context, bus.Received) error {
		return bus.Permanent(kvcore.ReasonUndecodable, errors.New("junk"))
	}
	e.run(e.consumerConfig(group, topic), poison)
	e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: huge})

	dead := e.readAll(dlqTopic, 1)[0]
	if len(dead.Value) != contract.MaxDeadLetterPayload || !bytes.HasPrefix(huge, dead.Value) {
		t.Errorf("dead letter value of %d bytes, want the first %d bytes of the record",
			len(dead.Value), contract.MaxDeadLetterPayload)
	}
	headers := map[string]string{}
	for _, h := range dead.Headers {
		headers[h.Key] = string(h.Value)
	}
	if got, want := headers[contract.HeaderPayloadBytes], strconv.Itoa(len(huge)); got != want {
		t.Errorf("header %s = %q, want %q", contract.HeaderPayloadBytes, got, want)
	}
	if got := headers[contract.HeaderPayloadTruncated]; got != "true" {
		t.Errorf("header %s = %q, want true", contract.HeaderPayloadTruncated, got)
	}
	if headers[contract.HeaderOrigTopic] != topic || headers[contract.HeaderReason] != string(kvcore.ReasonUndecodable) {
		t.Errorf("dead letter headers %v do not name the original record and reason", headers)
	}
}
