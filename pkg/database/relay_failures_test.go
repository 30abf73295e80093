package database_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// brokerTopic is the topic of the tests that publish to a real (kfake) broker.
const brokerTopic = "kvmesh.test.relay"

// startBroker starts an embedded broker with brokerTopic (4 partitions) and
// returns a producer on it; both are closed when the test ends.
func startBroker(t *testing.T) (*devbroker.Broker, *bus.Producer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 4, Topics: []string{brokerTopic},
		GroupMinSessionTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatalf("devbroker.Start: %v", err)
	}
	t.Cleanup(b.Close)
	p, err := bus.NewProducer(b.Addrs())
	if err != nil {
		t.Fatalf("NewProducer: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Producer.Close: %v", err)
		}
	})
	return b, p
}

// readTopic reads n records of topic from the beginning.
func readTopic(t *testing.T, brokers []string, topic string, n int) []kafka.Message {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: brokers, GroupID: "inspect-" + topic, Topic: topic, MaxWait: 100 * time.Millisecond,
		SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
	})
	defer func() { _ = r.Close() }()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	out := make([]kafka.Message, 0, n)
	for range n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("reading %s: got %d of %d records: %v", topic, len(out), n, err)
		}
		out = append(out, m)
	}
	return out
}

// byKey returns the values of msgs grouped by key, in the order read.
func byKey(msgs []kafka.Message) map[string][]string {
	out := map[string][]string{}
	for _, m := range msgs {
		out[string(m.Key)] = append(out[string(m.Key)], string(m.Value))
	}
	return out
}

// failedState is the stored failure state of one outbox row.
type failedState struct {
	Value      string
	Sent       bool
	Failed     bool
	FailReason *string
	LastError  *string
}

// rowStates returns the state of every outbox row, by its value (values
// longer than 16 bytes are cut to their first 16).
func rowStates(t *testing.T, pool *pgxpool.Pool) map[string]failedState {
	t.Helper()
	rows, _ := pool.Query(context.Background(), `SELECT substr(convert_from(value, 'UTF8'), 1, 16),
		sent_at IS NOT NULL, failed_at IS NOT NULL, fail_reason, last_error FROM outbox ORDER BY id`)
	list, err := pgx.CollectRows(rows, pgx.RowToStructByPos[failedState])
	if err != nil {
		t.Fatalf("read outbox: %v", err)
	}
	out := map[string]failedState{}
	for _, s := range list {
		out[s.Value] = s
	}
	return out
}

// TestRelayFailsUnpublishableRowWithoutBlocking: an oversized row among
// publishable rows of its own key and of another key is marked failed with
// a reason and listed by FailedRows, and every other row is published to a
// real broker in order per key. Once by the relay's own size bound, once by
// kafka-go's writer, which fails the whole call for the one message.
func TestRelayFailsUnpublishableRowWithoutBlocking(t *testing.T) {
	tests := []struct {
		name    string
		maxSize int64
	}{
		{"relay bound", 0},
		{"writer rejects the whole batch", 8 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			pool := dbtest.NewPool(t)
			broker, prod := startBroker(t)
			huge := "huge-" + strings.Repeat("x", 1200<<10) // 1.2 MB, over kafka-go's 1 MiB
			m := func(key, value string) bus.Message {
				return bus.Message{Topic: brokerTopic, Key: key, Value: []byte(value)}
			}
			enqueue(t, t.Context(), pool, m("a", "a1"), m("b", "b1"), m("a", huge), m("a", "a2"), m("b", "b2"))
			enqueue(t, t.Context(), pool, m("a", "a3"), m("c", "c1"))
			var opts []database.RelayOption
			if tt.maxSize > 0 {
				opts = append(opts, database.WithMaxMessageBytes(tt.maxSize))
			}
			var mu sync.Mutex
			reasons := map[database.FailReason]int{}
			opts = append(opts, database.WithFailureHook(func(reason database.FailReason) {
				mu.Lock()
				defer mu.Unlock()
				reasons[reason]++
			}))
			relay := startRelay(t, pool, prod, opts...)

			waitFor(t, "an empty backlog", func() bool {
				n, err := relay.Backlog(t.Context())
				return err == nil && n == 0
			})
			got := byKey(readTopic(t, broker.Addrs(), brokerTopic, 6))
			want := map[string][]string{"a": {"a1", "a2", "a3"}, "b": {"b1", "b2"}, "c": {"c1"}}
			for k, w := range want {
				// At least once: a duplicate is allowed, a reordering is not.
				if g := slices.Compact(slices.Clone(got[k])); !slices.Equal(g, w) {
					t.Errorf("key %s published %v, want %v in order", k, got[k], w)
				}
			}
			states := rowStates(t, pool)
			bad := states["huge-xxxxxxxxxxx"]
			if bad.Sent || !bad.Failed || bad.FailReason == nil || *bad.FailReason != string(database.ReasonMessageTooLarge) ||
				bad.LastError == nil || *bad.LastError == "" {
				t.Errorf("oversized row = %+v, want failed with reason %s and an error", bad, database.ReasonMessageTooLarge)
			}
			for v, s := range states {
				if v != "huge-xxxxxxxxxxx" && (!s.Sent || s.Failed) {
					t.Errorf("row %s = %+v, want sent", v, s)
				}
			}
			failed, err := relay.FailedRows(t.Context(), 0, 10)
			if err != nil || len(failed) != 1 {
				t.Fatalf("FailedRows = %+v, %v; want the oversized row", failed, err)
			}
			if f := failed[0]; f.Key != "a" || f.Topic != brokerTopic || f.Reason != database.ReasonMessageTooLarge ||
				f.ValueBytes != int64(len(huge)) || f.Attempts != 1 {
				t.Errorf("failed row = %+v, want key a, reason %s, %d value bytes, 1 attempt",
					f, database.ReasonMessageTooLarge, len(huge))
			}
			if n, err := relay.FailedCount(t.Context()); err != nil || n != 1 {
				t.Errorf("FailedCount = %d, %v; want 1", n, err)
			}
			mu.Lock()
			if reasons[database.ReasonMessageTooLarge] != 1 {
				t.Errorf("failure hook saw %v, want one %s", reasons, database.ReasonMessageTooLarge)
			}
			mu.Unlock()
		})
	}
}

// keyFailPublisher fails every message of one key transiently, with
// per-message errors as kafka-go reports them, while failing is set.
type keyFailPublisher struct {
	fakePublisher
	failKey string
}

func (p *keyFailPublisher) Publish(ctx context.Context, msgs ...bus.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if !p.failing {
		p.batches = append(p.batches, slices.Clone(msgs))
		return nil
	}
	werr := make(kafka.WriteErrors, len(msgs))
	var ok []bus.Message
	for i, m := range msgs {
		if m.Key == p.failKey {
			werr[i] = kafka.LeaderNotAvailable
			continue
		}
		ok = append(ok, m)
	}
	p.batches = append(p.batches, ok)
	if werr.Count() == 0 {
		return nil
	}
	return fmt.Errorf("bus: publish %d message(s): %w", len(msgs), werr)
}

// TestRelayTransientFailureDelaysOnlyItsKey: while one key's messages fail
// transiently, the rows of other keys are published, the failing key's rows
// stay pending behind its first (which backs off), and once the broker
// recovers that key's rows are published in order.
func TestRelayTransientFailureDelaysOnlyItsKey(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &keyFailPublisher{fakePublisher: fakePublisher{failing: true}, failKey: "a"}
	relay := startRelay(t, pool, pub)
	enqueue(t, t.Context(), pool, msg("a", "a1"), msg("b", "b1"), msg("a", "a2"))
	enqueue(t, t.Context(), pool, msg("b", "b2"), msg("a", "a3"), msg("c", "c1"))

	waitFor(t, "the other keys published", func() bool {
		n, err := relay.Backlog(t.Context())
		return err == nil && n == 3
	})
	if got := values(pub.published()); !slices.Equal(got, []string{"b1", "b2", "c1"}) {
		t.Errorf("published while key a fails: %v, want [b1 b2 c1]", got)
	}
	var backingOff int
	err := pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox
		WHERE key = 'a' AND sent_at IS NULL AND failed_at IS NULL AND next_attempt_at IS NOT NULL`).Scan(&backingOff)
	if err != nil || backingOff == 0 {
		t.Errorf("%d rows of key a back off (%v), want at least its first", backingOff, err)
	}
	// Key a's first row failed and backs off; the rows behind it are pending,
	// either held in the same batch (with a last_error naming the row that
	// holds them) or never claimed yet, depending on which enqueue the
	// relay's first batch saw.
	for v, s := range rowStates(t, pool) {
		switch {
		case !strings.HasPrefix(v, "a"):
		case s.Sent || s.Failed:
			t.Errorf("row %s = %+v, want pending", v, s)
		case v == "a1" && s.LastError == nil:
			t.Errorf("row a1 = %+v, want its publish error recorded", s)
		}
	}
	pub.setFailing(false)
	waitFor(t, "an empty backlog", func() bool {
		n, err := relay.Backlog(t.Context())
		return err == nil && n == 0
	})
	var keyA []string
	for _, m := range pub.published() {
		if m.Key == "a" {
			keyA = append(keyA, string(m.Value))
		}
	}
	if !slices.Equal(keyA, []string{"a1", "a2", "a3"}) {
		t.Errorf("key a published %v, want [a1 a2 a3]", keyA)
	}
	if n, err := relay.FailedCount(t.Context()); err != nil || n != 0 {
		t.Errorf("FailedCount = %d, %v; want 0 (transient failures never fail a row)", n, err)
	}
}

// TestRetryFailed: a failed row goes back on the relay path and is
// published; retrying a pending or unknown row says why it cannot.
func TestRetryFailed(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	pub := &fakePublisher{}
	relay := startRelay(t, pool, pub, database.WithMaxMessageBytes(1024))
	enqueue(t, t.Context(), pool, msg("k", strings.Repeat("z", 2048)), msg("k", "small"))
	waitFor(t, "an empty backlog", func() bool {
		n, err := relay.Backlog(t.Context())
		return err == nil && n == 0
	})
	failed, err := relay.FailedRows(t.Context(), 0, 10)
	if err != nil || len(failed) != 1 {
		t.Fatalf("FailedRows = %+v, %v; want one", failed, err)
	}
	if next, err := relay.FailedRows(t.Context(), failed[0].ID, 10); err != nil || len(next) != 0 {
		t.Errorf("FailedRows after the last = %+v, %v; want none", next, err)
	}
	// The operator "fixes the cause": here, by shrinking the stored value.
	if _, err := pool.Exec(t.Context(), "UPDATE outbox SET value = 'fixed', headers = '{}' WHERE id = $1", failed[0].ID); err != nil {
		t.Fatalf("fix row: %v", err)
	}
	if err := relay.RetryFailed(t.Context(), failed[0].ID); err != nil {
		t.Fatalf("RetryFailed: %v", err)
	}
	waitFor(t, "the retried row", func() bool { return len(pub.published()) == 2 })
	if got := values(pub.published()); !slices.Equal(got, []string{"small", "fixed"}) {
		t.Errorf("published %v, want [small fixed]", got)
	}
	tests := []struct {
		name string
		id   int64
		want error
	}{
		{"sent row", failed[0].ID, database.ErrOutboxRowNotFailed},
		{"unknown row", failed[0].ID + 1000, database.ErrOutboxRowNotFound},
	}
	for _, tt := range tests {
		if err := relay.RetryFailed(t.Context(), tt.id); !errors.Is(err, tt.want) {
			t.Errorf("%s: RetryFailed = %v, want %v", tt.name, err, tt.want)
		}
	}
}
