package bus_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

func TestErrorClassification(t *testing.T) {
	base := errors.New("boom")
	tests := []struct {
		name          string
		err           error
		transient     bool
		permanent     bool
		reason        kvcore.Reason
		unwrapsToBase bool
	}{
		{"transient", bus.Transient(base), true, false, "", true},
		{"wrapped transient", fmt.Errorf("save: %w", bus.Transient(base)), true, false, "", true},
		{"permanent", bus.Permanent("undecodable", base), false, true, "undecodable", true},
		{"wrapped permanent", fmt.Errorf("decode: %w", bus.Permanent("bad_group", base)), false, true, "bad_group", true},
		{"permanent without cause", bus.Permanent("too_late", nil), false, true, "too_late", false},
		{"plain", base, false, false, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := errors.Is(tt.err, bus.ErrTransient); got != tt.transient {
				t.Errorf("Is(ErrTransient) = %v, want %v", got, tt.transient)
			}
			if got := errors.Is(tt.err, bus.ErrPermanent); got != tt.permanent {
				t.Errorf("Is(ErrPermanent) = %v, want %v", got, tt.permanent)
			}
			var pe *bus.PermanentError
			if errors.As(tt.err, &pe) != tt.permanent || (tt.permanent && pe.Reason != tt.reason) {
				t.Errorf("As(PermanentError) = %v, want reason %q", pe, tt.reason)
			}
			if got := errors.Is(tt.err, base); got != tt.unwrapsToBase {
				t.Errorf("Is(base) = %v, want %v", got, tt.unwrapsToBase)
			}
		})
	}
	if bus.Transient(nil) != nil {
		t.Errorf("Transient(nil) != nil")
	}
}

func TestRetryPolicyBackoff(t *testing.T) {
	p := retry.Policy{MaxAttempts: 10, Backoff: retry.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}}
	tests := []struct {
		attempt int
		want    time.Duration
	}{
		{1, 10 * time.Millisecond},
		{2, 20 * time.Millisecond},
		{3, 40 * time.Millisecond},
		{4, 50 * time.Millisecond},
		{1000, 50 * time.Millisecond},
	}
	for _, tt := range tests {
		if got := p.Delay(tt.attempt); got != tt.want {
			t.Errorf("Delay(%d) = %v, want %v", tt.attempt, got, tt.want)
		}
	}
	if got := bus.DefaultRetry().Delay(1); got != bus.DefaultInitialBackoff {
		t.Errorf("default policy Delay(1) = %v, want the default %v", got, bus.DefaultInitialBackoff)
	}
}

func TestNewConsumerValidatesConfig(t *testing.T) {
	p, err := bus.NewProducer([]string{"127.0.0.1:1"})
	if err != nil {
		t.Fatalf("NewProducer: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	valid := func() bus.ConsumerConfig {
		return bus.ConsumerConfig{Brokers: []string{"127.0.0.1:1"}, GroupID: "g", Topics: []string{"t"}, DLQTopic: "dlq", Producer: p}
	}
	hook := func(context.Context, bus.Received, kvcore.Reason, error) error { return nil }
	tests := []struct {
		name   string
		change func(*bus.ConsumerConfig)
		ok     bool
	}{
		{"valid", func(*bus.ConsumerConfig) {}, true},
		{"hook as the only sink", func(c *bus.ConsumerConfig) { c.DLQTopic, c.Producer, c.OnDeadLetter = "", nil, hook }, true},
		{"no brokers", func(c *bus.ConsumerConfig) { c.Brokers = nil }, false},
		{"no group", func(c *bus.ConsumerConfig) { c.GroupID = "" }, false},
		{"no topics", func(c *bus.ConsumerConfig) { c.Topics = nil }, false},
		{"no dead-letter sink", func(c *bus.ConsumerConfig) { c.DLQTopic = "" }, false},
		{"DLQ without producer", func(c *bus.ConsumerConfig) { c.Producer = nil }, false},
		{"DLQ is consumed", func(c *bus.ConsumerConfig) { c.Topics = []string{"t", "dlq"} }, false},
		{"heartbeat above session", func(c *bus.ConsumerConfig) { c.HeartbeatInterval = time.Minute }, false},
		{"negative attempts", func(c *bus.ConsumerConfig) { c.Retry.MaxAttempts = -1 }, false},
		{"max below initial backoff", func(c *bus.ConsumerConfig) {
			c.Retry.Backoff = retry.Backoff{Initial: time.Second, Max: time.Millisecond}
		}, false},
		{"concurrent", func(c *bus.ConsumerConfig) { c.Concurrency = 16 }, true},
		{"negative concurrency", func(c *bus.ConsumerConfig) { c.Concurrency = -1 }, false},
		{"negative batch size", func(c *bus.ConsumerConfig) { c.BatchSize = -1 }, false},
		{"negative batch linger", func(c *bus.ConsumerConfig) { c.BatchLinger = -time.Millisecond }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := valid()
			tt.change(&cfg)
			_, err := bus.NewConsumer(cfg, func(context.Context, bus.Received) error { return nil })
			if tt.ok && err != nil {
				t.Fatalf("NewConsumer = %v, want nil", err)
			}
			if !tt.ok && !errors.Is(err, bus.ErrInvalidConfig) {
				t.Fatalf("NewConsumer = %v, want ErrInvalidConfig", err)
			}
		})
	}
	if _, err := bus.NewConsumer(valid(), nil); !errors.Is(err, bus.ErrInvalidConfig) {
		t.Fatalf("NewConsumer with nil handler = %v, want ErrInvalidConfig", err)
	}

	batchHandler := func(context.Context, []bus.Received) error { return nil }
	batchTests := []struct {
		name   string
		change func(*bus.ConsumerConfig)
		h      bus.BatchHandler
		ok     bool
	}{
		{"valid", func(*bus.ConsumerConfig) {}, batchHandler, true},
		{"one lane", func(c *bus.ConsumerConfig) { c.Concurrency = 1 }, batchHandler, true},
		{"nil handler", func(*bus.ConsumerConfig) {}, nil, false},
		{"concurrent", func(c *bus.ConsumerConfig) { c.Concurrency = 2 }, batchHandler, false},
		{"negative batch size", func(c *bus.ConsumerConfig) { c.BatchSize = -1 }, batchHandler, false},
		{"no group", func(c *bus.ConsumerConfig) { c.GroupID = "" }, batchHandler, false},
	}
	for _, tt := range batchTests {
		t.Run("batch/"+tt.name, func(t *testing.T) {
			cfg := valid()
			tt.change(&cfg)
			_, err := bus.NewBatchConsumer(cfg, tt.h)
			if tt.ok && err != nil {
				t.Fatalf("NewBatchConsumer = %v, want nil", err)
			}
			if !tt.ok && !errors.Is(err, bus.ErrInvalidConfig) {
				t.Fatalf("NewBatchConsumer = %v, want ErrInvalidConfig", err)
			}
		})
	}
}

func TestRecordErrorsText(t *testing.T) {
	tests := []struct {
		name string
		errs bus.RecordErrors
		want string
	}{
		{"none", bus.RecordErrors{}, "bus: 0 record(s) of the batch failed: "},
		{"in index order", bus.RecordErrors{3: errors.New("b"), 1: bus.Permanent("bad", errors.New("a"))},
			"bus: 2 record(s) of the batch failed: record 1: bad: a; record 3: b"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.errs.Error(); got != tt.want {
				t.Fatalf("Error() = %q, want %q", got, tt.want)
			}
		})
	}
}
