package bus_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
)

// TestConsumerRidesOutBrokerOutage stops the broker under a running
// consumer of each kind (one record at a time, concurrent lanes, batches)
// until its fetch has failed, and brings the broker back on the same
// address with what it persisted: Run does not return, and a record
// published after the outage is handled.
func TestConsumerRidesOutBrokerOutage(t *testing.T) {
	for _, kind := range []string{"single", "concurrent", "batch"} {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*waitLimit)
			defer cancel()
			const topic = "bus.test.outage"
			cfg := devbroker.Config{Addr: "127.0.0.1:0", Partitions: 1, Topics: []string{topic, dlqTopic},
				GroupMinSessionTimeout: 100 * time.Millisecond, DataDir: t.TempDir()}
			b, err := devbroker.Start(ctx, cfg)
			if err != nil {
				t.Fatalf("devbroker.Start: %v", err)
			}
			cfg.Addr = b.Addrs()[0]
			e := &env{t: t, ctx: ctx, broker: b}
			e.dlq = e.producer()
			logs := &testenv.SyncBuffer{}
			cc := e.consumerConfig("outage-"+kind, topic)
			cc.Logger = slog.New(slog.NewTextHandler(logs, nil))
			got := &seen[string]{}
			handle := func(_ context.Context, m bus.Received) error { got.add(string(m.Value)); return nil }
			var c *bus.Consumer
			switch kind {
			case "single":
				c, err = bus.NewConsumer(cc, handle)
			case "concurrent":
				cc.Concurrency = 4
				c, err = bus.NewConsumer(cc, handle)
			case "batch":
				cc.BatchSize = 8
				c, err = bus.NewBatchConsumer(cc, func(ctx context.Context, ms []bus.Received) error {
					for _, m := range ms {
						got.add(string(m.Value))
					}
					return nil
				})
			}
			if err != nil {
				t.Fatal(err)
			}
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- c.Run(runCtx) }()
			defer func() {
				stop()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()
			e.publish(e.dlq, bus.Message{Topic: topic, Key: "k", Value: []byte("before")})
			eventually(t, "the record before the outage", func() bool { return slices.Contains(got.snapshot(), "before") })

			b.Close()
			eventually(t, "a failed fetch", func() bool { return strings.Contains(logs.String(), "kafka fetch failed") })
			select {
			case err := <-done:
				t.Fatalf("Run returned during the outage: %v", err)
			default:
			}
			b2, err := devbroker.Start(ctx, cfg)
			if err != nil {
				t.Fatalf("restarting the broker: %v", err)
			}
			defer b2.Close()
			p, err := bus.NewProducer(b2.Addrs())
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			if err := p.Publish(ctx, bus.Message{Topic: topic, Key: "k", Value: []byte("after")}); err != nil {
				t.Fatalf("Publish after the outage: %v", err)
			}
			eventually(t, "the record after the outage", func() bool { return slices.Contains(got.snapshot(), "after") })
		})
	}
}
