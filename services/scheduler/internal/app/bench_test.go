package app_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// BenchmarkScheduler measures the scheduler end to end (Kafka in, one
// PostgreSQL transaction per record, outbox relay, Kafka out) on one
// running scheduler with 4 consumer-group members. It logs whether the
// database runs with fsync on (the dev cluster runs with fsync off unless
// KVMESH_DEV_PG_FSYNC=on) and reports it as fsync_on.
func BenchmarkScheduler(b *testing.B) {
	h := newMesh(b, meshOptions{consumers: 4})
	var fsync, syncCommit string
	if err := h.pool.QueryRow(h.ctx, `SELECT current_setting('fsync'), current_setting('synchronous_commit')`).Scan(&fsync, &syncCommit); err != nil {
		b.Fatal(err)
	}
	b.Logf("PostgreSQL fsync=%s synchronous_commit=%s", fsync, syncCommit)
	fsyncOn := 0.0
	if fsync == "on" {
		fsyncOn = 1
	}
	b.Run("events", func(b *testing.B) {
		benchEvents(b, h.onB(b))
		b.ReportMetric(fsyncOn, "fsync_on")
	})
	// The same with the SDK tracer provider a service installs when no
	// exporter is configured: every span (consumer, apply, database,
	// outbox publish) is recorded, none exported.
	b.Run("events_traced", func(b *testing.B) {
		tp := sdktrace.NewTracerProvider()
		prev := otel.GetTracerProvider()
		otel.SetTracerProvider(tp)
		defer func() {
			otel.SetTracerProvider(prev)
			_ = tp.Shutdown(context.Background())
		}()
		benchEvents(b, h.onB(b))
		b.ReportMetric(fsyncOn, "fsync_on")
	})
	// The latency at 2,000 events/s, and at 500 events/s for a baseline
	// below saturation.
	for _, rate := range []int{2000, 500} {
		b.Run(fmt.Sprintf("latency_%deps", rate), func(b *testing.B) {
			benchLatency(b, h.onB(b), rate, 2*time.Second)
			b.ReportMetric(fsyncOn, "fsync_on")
		})
	}
}

// onB returns a copy of h whose failures are reported on b.
func (h *mesh) onB(b *testing.B) *mesh {
	c := *h
	c.t = b
	return &c
}

// newStep is one engine event that creates a request and yields one save.
func newStep(h *mesh, engine, id string) keyed {
	return keyed{id, contract.EngineEvent{
		Schema: contract.SchemaEngineEvent, EventID: "1", EngineID: engine, RequestID: id, Seq: 1,
		Kind: contract.EventScheduled, Model: h.model.Name,
		Step: &kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3), Hashes: hashes(3)},
	}}
}

// benchEvents produces b.N engine events (requests of admitted, scheduled
// with one save, finished) at once and reports how many the scheduler
// applied per second.
func benchEvents(b *testing.B, h *mesh) {
	engine := randomID("bench-e-")
	events := make([]keyed, 0, b.N)
	for i := 0; len(events) < b.N; i++ {
		id := fmt.Sprintf("r%d", i)
		kinds := []contract.EngineEvent{
			{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(3)},
			{Kind: contract.EventScheduled, Step: &kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)}},
			{Kind: contract.EventFinished},
		}
		for seq, ev := range kinds[:min(len(kinds), b.N-len(events))] {
			ev.Schema, ev.EngineID, ev.RequestID, ev.Model = contract.SchemaEngineEvent, engine, id, h.model.Name
			ev.Seq, ev.EventID = int64(seq+1), fmt.Sprint(seq+1)
			events = append(events, keyed{id, ev})
		}
	}
	b.ResetTimer()
	h.produce(contract.TopicEngineEvents, events...)
	eventually(b, fmt.Sprintf("%d events applied", b.N), func() bool {
		var n int
		err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM processed_records WHERE kind = 'event' AND engine_id = $1`, engine).Scan(&n)
		return err == nil && n == b.N
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}

// benchLatency produces one save-yielding event every 1/rate s for d and
// reports the event → save-task latency (produce call to the task read
// back from Kafka) at p50 and p99. It runs the same workload whatever b.N.
func benchLatency(b *testing.B, h *mesh, rate int, d time.Duration) {
	transport := &kafka.Transport{}
	w := &kafka.Writer{Addr: kafka.TCP(h.brokers...), Balancer: &kafka.Murmur2Balancer{}, BatchTimeout: time.Millisecond,
		Async: true, Transport: transport}
	defer transport.CloseIdleConnections()
	defer w.Close()
	engine := randomID("lat-e-")
	sent := map[string]time.Time{}
	ticker := time.NewTicker(5 * time.Millisecond)
	defer ticker.Stop()
	b.ResetTimer()
	for start, i := time.Now(), 0; time.Since(start) < d; <-ticker.C {
		now := time.Now()
		due := int(now.Sub(start).Seconds()*float64(rate)) - i
		msgs := make([]kafka.Message, 0, due)
		for range due {
			id := fmt.Sprintf("r%d", i)
			i++
			ev := newStep(h, engine, id)
			v, err := jsonValue(ev.value)
			if err != nil {
				b.Fatal(err)
			}
			msgs = append(msgs, kafka.Message{Topic: contract.TopicEngineEvents, Key: []byte(id), Value: v})
			sent[id] = now
		}
		if err := w.WriteMessages(context.Background(), msgs...); err != nil {
			b.Fatal(err)
		}
	}
	var lat []time.Duration
	eventually(b, fmt.Sprintf("%d save tasks", len(sent)), func() bool {
		lat = h.out.latencies(engine, sent)
		return len(lat) == len(sent)
	})
	b.StopTimer()
	slices.Sort(lat)
	ms := func(q float64) float64 { return float64(lat[int(q*float64(len(lat)-1))]) / float64(time.Millisecond) }
	b.ReportMetric(ms(0.50), "p50-ms")
	b.ReportMetric(ms(0.99), "p99-ms")
	b.ReportMetric(float64(len(sent))/d.Seconds(), "events/s")
}

// latencies returns, for each save task of engine read so far, the time
// from its event's produce call to its arrival.
func (c *collector) latencies(engine string, sent map[string]time.Time) []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []time.Duration
	for _, m := range c.records[contract.TopicSaveTasks] {
		if at, ok := sent[m.requestID]; ok && m.engineID == engine {
			out = append(out, m.at.Sub(at))
		}
	}
	return out
}
