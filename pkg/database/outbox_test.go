package database_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
)

var errBrokerDown = errors.New("broker down")

// fakePublisher records what it is asked to publish and fails while failing is set.
type fakePublisher struct {
	mu      sync.Mutex
	failing bool
	calls   int
	batches [][]bus.Message
}

func (p *fakePublisher) Publish(_ context.Context, msgs ...bus.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.failing {
		return errBrokerDown
	}
	p.batches = append(p.batches, slices.Clone(msgs))
	return nil
}

func (p *fakePublisher) setFailing(v bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failing = v
}

// published returns every message published so far, in order.
func (p *fakePublisher) published() []bus.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	var all []bus.Message
	for _, b := range p.batches {
		all = append(all, b...)
	}
	return all
}

// startRelay runs a relay until the test ends, then checks Run returned nil.
func startRelay(t *testing.T, pool *pgxpool.Pool, pub database.Publisher, opts ...database.RelayOption) *database.Relay {
	t.Helper()
	opts = append([]database.RelayOption{
		database.WithLogger(slog.New(slog.NewTextHandler(t.Output(), nil))),
		database.WithBackoff(5*time.Millisecond, 20*time.Millisecond),
		database.WithPollInterval(50 * time.Millisecond),
	}, opts...)
	r := database.NewRelay(pool, pub, opts...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run returned %v after cancel, want nil", err)
		}
	})
	return r
}

// waitFor polls cond until it holds, failing the test after a deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond) // poll interval, not synchronisation
	}
}

// enqueue commits msgs in one transaction.
func enqueue(t *testing.T, ctx context.Context, pool *pgxpool.Pool, msgs ...bus.Message) {
	t.Helper()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return database.Enqueue(ctx, tx, msgs...) })
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
}

// msg builds a message on the test topic.
func msg(key, value string) bus.Message {
	return bus.Message{Topic: "kvmesh.test", Key: key, Value: []byte(value), Headers: map[string]string{"h": value}}
}

// values returns the values of msgs as strings.
func values(msgs []bus.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = string(m.Value)
	}
	return out
}

// row is the stored state of one outbox row.
type row struct {
	Sent      bool
	Attempts  int
	LastError *string
}

// outboxRows returns every outbox row in id order.
func outboxRows(t *testing.T, pool *pgxpool.Pool) []row {
	t.Helper()
	rows, _ := pool.Query(context.Background(),
		"SELECT sent_at IS NOT NULL, attempts, last_error FROM outbox ORDER BY id")
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatalf("read outbox: %v", err)
	}
	return out
}

func TestRelayPublishesCommittedMessagesInOrder(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{}
	startRelay(t, pool, pub, database.WithBatchSize(4))
	var want []bus.Message
	for tx := range 3 {
		var batch []bus.Message
		for i := range 4 {
			batch = append(batch, msg([]string{"a", "b"}[i%2], fmt.Sprintf("v%d-%d", tx, i)))
		}
		enqueue(t, t.Context(), pool, batch...)
		want = append(want, batch...)
	}
	tombstone := bus.Message{Topic: "kvmesh.other", Key: "a"}
	enqueue(t, t.Context(), pool, tombstone)
	want = append(want, bus.Message{Topic: "kvmesh.other", Key: "a", Headers: map[string]string{}})

	relay := database.NewRelay(pool, nil)
	waitFor(t, "every row marked sent", func() bool {
		n, err := relay.Backlog(t.Context())
		return err == nil && n == 0
	})
	got := pub.published()
	if len(got) != len(want) {
		t.Fatalf("published %d messages, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Topic != want[i].Topic || got[i].Key != want[i].Key ||
			string(got[i].Value) != string(want[i].Value) || !maps.Equal(got[i].Headers, want[i].Headers) {
			t.Errorf("message %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	if got[len(got)-1].Value != nil {
		t.Errorf("nil value came back as %q", got[len(got)-1].Value)
	}
	pub.mu.Lock()
	for i, b := range pub.batches {
		if len(b) > 4 {
			t.Errorf("batch %d has %d messages, want at most 4", i, len(b))
		}
	}
	pub.mu.Unlock()
	for i, r := range outboxRows(t, pool) {
		if !r.Sent || r.Attempts != 1 {
			t.Errorf("row %d = %+v, want sent after 1 attempt", i, r)
		}
	}
}

func TestRelayIgnoresRolledBackEnqueue(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{}
	startRelay(t, pool, pub)
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	if err := database.Enqueue(t.Context(), tx, msg("k", "rolled-back")); err != nil {
		t.Fatalf("Enqueue: %v", err)
	}
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatalf("rollback: %v", err)
	}
	enqueue(t, t.Context(), pool, msg("k", "committed"))
	waitFor(t, "the committed message", func() bool { return len(pub.published()) > 0 })
	if got := values(pub.published()); !slices.Equal(got, []string{"committed"}) {
		t.Errorf("published %v, want only [committed]", got)
	}
}

func TestRelayRetriesUntilPublisherRecovers(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{failing: true}
	startRelay(t, pool, pub)
	enqueue(t, t.Context(), pool, msg("k", "one"), msg("k", "two"))
	waitFor(t, "three failed attempts", func() bool {
		rows := outboxRows(t, pool)
		return len(rows) == 2 && rows[0].Attempts >= 3 && rows[1].Attempts >= 3
	})
	for i, r := range outboxRows(t, pool) {
		if r.Sent || r.LastError == nil || !strings.Contains(*r.LastError, "broker down") {
			t.Errorf("row %d while failing = %+v, want unsent with last_error", i, r)
		}
	}
	if n := len(pub.published()); n != 0 {
		t.Fatalf("%d messages published while the publisher failed", n)
	}
	pub.setFailing(false)
	waitFor(t, "rows marked sent", func() bool {
		rows := outboxRows(t, pool)
		return rows[0].Sent && rows[1].Sent
	})
	if got := values(pub.published()); !slices.Equal(got, []string{"one", "two"}) {
		t.Errorf("published %v, want [one two] exactly once", got)
	}
	pub.mu.Lock()
	calls := pub.calls
	pub.mu.Unlock()
	for i, r := range outboxRows(t, pool) {
		if r.Attempts != calls {
			t.Errorf("row %d attempts = %d, want %d (every Publish call)", i, r.Attempts, calls)
		}
	}
}

func TestConcurrentRelaysPublishEachRowOnce(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{}
	startRelay(t, pool, pub, database.WithBatchSize(7))
	startRelay(t, pool, pub, database.WithBatchSize(7))
	const writers, txs, perTx = 4, 10, 5
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for tx := range txs {
				var batch []bus.Message
				for i := range perTx {
					batch = append(batch, msg(fmt.Sprintf("w%d", w), fmt.Sprintf("w%d-%03d", w, tx*perTx+i)))
				}
				enqueue(t, context.Background(), pool, batch...)
			}
		})
	}
	wg.Wait()
	const total = writers * txs * perTx
	relay := database.NewRelay(pool, nil)
	waitFor(t, "empty backlog", func() bool {
		n, err := relay.Backlog(t.Context())
		return err == nil && n == 0
	})
	got := pub.published()
	if len(got) != total {
		t.Errorf("published %d messages, want %d", len(got), total)
	}
	seen := map[string]bool{}
	last := map[string]string{}
	for _, m := range got {
		v := string(m.Value)
		if seen[v] {
			t.Errorf("%s published twice", v)
		}
		seen[v] = true
		if v <= last[m.Key] {
			t.Errorf("key %s: %s published after %s", m.Key, v, last[m.Key])
		}
		last[m.Key] = v
	}
}

// TestConcurrentRelaysNeedNoPolling runs two relays that never poll while
// writers commit rows: a relay that finds the batch lock held claims
// nothing, and every row must still go out, woken by notifications alone,
// each once and in order per key.
func TestConcurrentRelaysNeedNoPolling(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{}
	startRelay(t, pool, pub, database.WithPollInterval(time.Hour))
	startRelay(t, pool, pub, database.WithPollInterval(time.Hour))
	const writers, txs = 4, 25
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for tx := range txs {
				enqueue(t, context.Background(), pool, msg(fmt.Sprintf("w%d", w), fmt.Sprintf("w%d-%03d", w, tx)))
			}
		})
	}
	wg.Wait()
	relay := database.NewRelay(pool, nil)
	waitFor(t, "every row published without polling", func() bool {
		n, err := relay.Backlog(t.Context())
		return err == nil && n == 0
	})
	last := map[string]string{}
	for _, m := range pub.published() {
		if v := string(m.Value); v <= last[m.Key] {
			t.Errorf("key %s: %s published after %s", m.Key, v, last[m.Key])
		} else {
			last[m.Key] = v
		}
	}
	if got := len(pub.published()); got != writers*txs {
		t.Errorf("published %d messages, want %d", got, writers*txs)
	}
}

// TestRelayWakesForItsOwnService: a relay that never polls publishes at
// once what its own service (application_name) commits, woken by the
// notification that names it; what another service commits reaches the
// bus through a relay's poll when none of that service's relays runs.
func TestRelayWakesForItsOwnService(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	other, err := database.Connect(t.Context(), pool.Config().ConnString(), database.WithApplicationName("kvmesh-other"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	own := &fakePublisher{}
	startRelay(t, pool, own, database.WithPollInterval(time.Hour))
	enqueue(t, t.Context(), pool, msg("k", "own"))
	waitFor(t, "the own service's row, without polling", func() bool { return len(own.published()) == 1 })
	polled := &fakePublisher{}
	startRelay(t, pool, polled, database.WithPollInterval(20*time.Millisecond))
	enqueue(t, t.Context(), other, msg("k", "other"))
	waitFor(t, "the other service's row, by a poll", func() bool {
		return len(own.published())+len(polled.published()) == 2
	})
}

func TestRelayWakesOnNotification(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{}
	startRelay(t, pool, pub, database.WithPollInterval(time.Hour))
	enqueue(t, t.Context(), pool, msg("k", "first"))
	waitFor(t, "first message", func() bool { return len(pub.published()) == 1 })
	enqueue(t, t.Context(), pool, msg("k", "second"))
	waitFor(t, "second message without polling", func() bool { return len(pub.published()) == 2 })
}

func TestRelayRecoversFromTerminatedConnections(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	conn, err := pgx.Connect(t.Context(), pool.Config().ConnString())
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	pub := &fakePublisher{}
	startRelay(t, pool, pub, database.WithPollInterval(time.Hour))
	enqueue(t, t.Context(), pool, msg("k", "before"))
	waitFor(t, "first message", func() bool { return len(pub.published()) == 1 })

	var killed int
	err = conn.QueryRow(t.Context(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&killed)
	if err != nil || killed == 0 {
		t.Fatalf("terminated %d backends (%v), want the relay's", killed, err)
	}
	err = pgx.BeginFunc(t.Context(), conn, func(tx pgx.Tx) error {
		return database.Enqueue(t.Context(), tx, msg("k", "after"))
	})
	if err != nil {
		t.Fatalf("enqueue after termination: %v", err)
	}
	// "before" may be published twice (at least once: the kill can hit the
	// relay between Publish and its commit), so wait for "after" itself.
	waitFor(t, "message enqueued after the relay lost its connections", func() bool {
		return slices.Contains(values(pub.published()), "after")
	})
}

func TestEnqueueCarriesTraceContext(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(t.Context(), sc)
	headers := map[string]string{"h": "x"}
	enqueue(t, ctx, pool, bus.Message{Topic: "kvmesh.test", Key: "k", Headers: headers})
	enqueue(t, t.Context(), pool, bus.Message{Topic: "kvmesh.test", Key: "untraced"})

	if _, ok := headers["traceparent"]; ok || len(headers) != 1 {
		t.Errorf("Enqueue modified the caller's headers: %v", headers)
	}
	pub := &fakePublisher{}
	startRelay(t, pool, pub)
	waitFor(t, "both messages", func() bool { return len(pub.published()) == 2 })
	got := pub.published()
	want := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	if tp := got[0].Headers["traceparent"]; tp != want || got[0].Headers["h"] != "x" {
		t.Errorf("traced message headers = %v, want traceparent %s and h=x", got[0].Headers, want)
	}
	if tp, ok := got[1].Headers["traceparent"]; ok {
		t.Errorf("untraced message has traceparent %q", tp)
	}
}

func TestEnqueueRejectsMissingTopic(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	err := pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		return database.Enqueue(t.Context(), tx, msg("k", "ok"), bus.Message{Key: "k"})
	})
	if !errors.Is(err, database.ErrEmptyTopic) {
		t.Fatalf("Enqueue error = %v, want ErrEmptyTopic", err)
	}
	if rows := outboxRows(t, pool); len(rows) != 0 {
		t.Errorf("%d rows stored by a failed Enqueue", len(rows))
	}
}

func TestBacklogAndPurgeSent(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	relay := database.NewRelay(pool, &fakePublisher{})
	var batch []bus.Message
	for i := range 5 {
		batch = append(batch, msg("k", fmt.Sprint(i)))
	}
	enqueue(t, t.Context(), pool, batch...)
	if n, err := relay.Backlog(t.Context()); err != nil || n != 5 {
		t.Fatalf("Backlog = %d, %v; want 5", n, err)
	}
	_, err := pool.Exec(t.Context(), `UPDATE outbox SET sent_at = CASE
		WHEN id <= (SELECT min(id) + 1 FROM outbox) THEN now() - interval '2 hours'
		ELSE now() END
		WHERE id <= (SELECT min(id) + 2 FROM outbox)`)
	if err != nil {
		t.Fatalf("mark rows sent: %v", err)
	}
	if n, err := relay.Backlog(t.Context()); err != nil || n != 2 {
		t.Errorf("Backlog after sending 3 = %d, %v; want 2", n, err)
	}
	if n, err := relay.PurgeSent(t.Context(), time.Hour); err != nil || n != 2 {
		t.Errorf("PurgeSent(1h) = %d, %v; want 2 (rows sent 2h ago)", n, err)
	}
	if n, err := relay.PurgeSent(t.Context(), time.Hour); err != nil || n != 0 {
		t.Errorf("second PurgeSent(1h) = %d, %v; want 0", n, err)
	}
	if rows := outboxRows(t, pool); len(rows) != 3 {
		t.Errorf("%d rows left, want 3 (one recent sent, two unsent)", len(rows))
	}
}

// TestEnqueueBatchAndCopyKeepOrderAndTraces enqueues through the two
// set-based paths in one transaction: the relay publishes every message in
// the order given, each with the trace context it carried or ctx's.
func TestEnqueueBatchAndCopyKeepOrderAndTraces(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(t.Context(), sc)
	own := "00-0a000000000000000000000000000000-0b00000000000000-01"
	first := []bus.Message{msg("k", "0"), {Topic: "kvmesh.test", Key: "k", Value: []byte("1"), Headers: map[string]string{"traceparent": own}}}
	second := []bus.Message{msg("k", "2"), msg("j", "3")}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if err := database.EnqueueBatch(ctx, b, first); err != nil {
			return err
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		return database.EnqueueCopy(ctx, tx, second)
	})
	if err != nil {
		t.Fatal(err)
	}
	pub := &fakePublisher{}
	startRelay(t, pool, pub)
	waitFor(t, "four messages", func() bool { return len(pub.published()) == 4 })
	got := pub.published()
	ctxTrace := "00-01000000000000000000000000000000-0200000000000000-01"
	for i, want := range []string{ctxTrace, own, ctxTrace, ctxTrace} {
		if string(got[i].Value) != fmt.Sprint(i) || got[i].Headers["traceparent"] != want {
			t.Errorf("message %d: value %q traceparent %q, want %d and %s", i, got[i].Value, got[i].Headers["traceparent"], i, want)
		}
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return database.EnqueueCopy(ctx, tx, []bus.Message{{Key: "k"}})
	})
	if !errors.Is(err, database.ErrEmptyTopic) {
		t.Fatalf("EnqueueCopy without a topic: %v, want ErrEmptyTopic", err)
	}
}
