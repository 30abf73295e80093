package database_test

import (
	"context"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// startDirect runs a Direct until the test ends, then checks Run returned nil.
func startDirect(t *testing.T, pool *pgxpool.Pool, pub database.Publisher, relay *database.Relay, opts ...database.DirectOption) *database.Direct {
	t.Helper()
	d := newDirect(t, pool, pub, relay, opts...)
	servicetest.Start(t, d.Run)
	return d
}

func newDirect(t *testing.T, pool *pgxpool.Pool, pub database.Publisher, relay *database.Relay, opts ...database.DirectOption) *database.Direct {
	t.Helper()
	opts = append([]database.DirectOption{database.WithDirectLogger(slog.New(slog.NewTextHandler(t.Output(), nil)))}, opts...)
	d, err := database.NewDirect(pool, pub, relay, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// commitDirect commits msgs in one transaction through d's enqueue, as
// the scheduler's ledger does (BEGIN, the insert and COMMIT in one
// pipeline), and returns the rows to hand to d.
func commitDirect(t *testing.T, pool *pgxpool.Pool, d *database.Direct, msgs ...bus.Message) *database.DirectRows {
	t.Helper()
	ctx := t.Context()
	batch := &pgx.Batch{}
	batch.Queue("BEGIN")
	rows, err := d.EnqueueBatch(ctx, batch, msgs)
	if err != nil {
		t.Fatal(err)
	}
	batch.Queue("COMMIT")
	if err := pool.SendBatch(ctx, batch).Close(); err != nil {
		t.Fatalf("commit: %v", err)
	}
	return rows
}

// pendingLeases returns, per pending row in id order, whether it is leased.
func pendingLeases(t *testing.T, pool *pgxpool.Pool) []bool {
	t.Helper()
	rows, _ := pool.Query(t.Context(), "SELECT publish_after IS NOT NULL FROM outbox WHERE sent_at IS NULL ORDER BY id")
	out, err := pgx.CollectRows(rows, pgx.RowTo[bool])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestDirectPublishesOnCommit(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	relayPub, directPub := &fakePublisher{}, &fakePublisher{}
	relay := startRelay(t, pool, relayPub, database.WithPollInterval(time.Hour))
	d := startDirect(t, pool, directPub, relay)
	d.Committed(commitDirect(t, pool, d, msg("a", "a1"), msg("b", "b1")))
	d.Committed(commitDirect(t, pool, d, msg("a", "a2")))
	waitFor(t, "three rows marked sent", func() bool {
		rows := outboxRows(t, pool)
		return len(rows) == 3 && !slices.ContainsFunc(rows, func(r row) bool { return !r.Sent })
	})
	if got, want := values(directPub.published()), []string{"a1", "b1", "a2"}; !slices.Equal(got, want) {
		t.Errorf("published on commit %v, want %v", got, want)
	}
	if got := directPub.published()[0].Headers["h"]; got != "a1" {
		t.Errorf("published headers lost the stored header: h=%q", got)
	}
	if n := len(relayPub.published()); n != 0 {
		t.Errorf("the relay published %d rows, want none: its commits are the Direct's", n)
	}
}

func TestDirectReleasesWhatItCannotPublish(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	relayPub, directPub := &fakePublisher{}, &fakePublisher{}
	directPub.setFailing(true)
	relay := startRelay(t, pool, relayPub, database.WithPollInterval(time.Hour))
	d := startDirect(t, pool, directPub, relay)
	d.Committed(commitDirect(t, pool, d, msg("k", "1")))
	d.Committed(commitDirect(t, pool, d, msg("k", "2"), msg("j", "3")))
	waitFor(t, "the relay to publish the released rows", func() bool { return len(relayPub.published()) == 3 })
	if got, want := values(relayPub.published()), []string{"1", "2", "3"}; !slices.Equal(got, want) {
		t.Errorf("the relay published %v, want %v (in order)", got, want)
	}
	// Healthy again: a new key publishes on commit; the key whose rows
	// were released does too once the relay marked them sent.
	directPub.setFailing(false)
	waitFor(t, "every row sent", func() bool { return len(pendingLeases(t, pool)) == 0 })
	d.Committed(commitDirect(t, pool, d, msg("k", "4")))
	waitFor(t, "the next row, on commit", func() bool { return len(directPub.published()) == 1 })
}

func TestDirectLeavesAKeyBehindAnotherPendingRowToTheRelay(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	enqueue(t, t.Context(), pool, msg("k", "relayed first")) // no relay runs yet: it stays pending
	relayPub, directPub := &fakePublisher{}, &fakePublisher{}
	d := newDirect(t, pool, directPub, nil)
	rows := commitDirect(t, pool, d, msg("k", "behind it"), msg("j", "free"))
	if got, want := pendingLeases(t, pool), []bool{false, false, true}; !slices.Equal(got, want) {
		t.Fatalf("pending rows leased %v, want %v: only the key with nothing pending is leased", got, want)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	d.Committed(rows)
	waitFor(t, "the free key, on commit", func() bool { return len(directPub.published()) == 1 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	startRelay(t, pool, relayPub)
	waitFor(t, "the relay to publish the key's rows", func() bool { return len(relayPub.published()) == 2 })
	if got, want := values(relayPub.published()), []string{"relayed first", "behind it"}; !slices.Equal(got, want) {
		t.Errorf("the relay published %v, want %v", got, want)
	}
	if got := values(directPub.published()); !slices.Equal(got, []string{"free"}) {
		t.Errorf("published on commit %v, want [free]", got)
	}
}

func TestRelayLeavesALeasedRowUntilItsLeaseEnds(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	const lease = 400 * time.Millisecond
	d := newDirect(t, pool, &fakePublisher{}, nil, database.WithDirectLease(lease))
	start := time.Now()
	commitDirect(t, pool, d, msg("k", "orphan")) // the process died before publishing: never handed over
	enqueue(t, t.Context(), pool, msg("k", "later"))
	relayPub := &fakePublisher{}
	startRelay(t, pool, relayPub, database.WithPollInterval(20*time.Millisecond))
	waitFor(t, "both rows, once the lease ended", func() bool { return len(relayPub.published()) == 2 })
	if waited := time.Since(start); waited < lease {
		t.Errorf("the relay published a leased row after %v, before its lease of %v ended", waited, lease)
	}
	if got, want := values(relayPub.published()), []string{"orphan", "later"}; !slices.Equal(got, want) {
		t.Errorf("the relay published %v, want %v: the later row of the key waits behind the leased one", got, want)
	}
}

func TestDirectReleasesWhatIsQueuedWhenItStops(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	d := newDirect(t, pool, &fakePublisher{}, nil, database.WithDirectLease(time.Hour))
	d.Committed(commitDirect(t, pool, d, msg("k", "queued")))
	ctx, cancel := context.WithCancel(t.Context())
	cancel() // Run stops at once, with the row still queued
	if err := d.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if got := pendingLeases(t, pool); !slices.Equal(got, []bool{false}) {
		t.Fatalf("pending rows leased %v after Run stopped, want [false]: released to the relays", got)
	}
	d.Committed(commitDirect(t, pool, d, msg("j", "after the stop")))
	if got := pendingLeases(t, pool); !slices.Equal(got, []bool{false, false}) {
		t.Fatalf("pending rows leased %v after a commit handed over once Run stopped, want [false false]", got)
	}
}

func TestDirectCommitWakesNoRelay(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	other, err := database.Connect(t.Context(), pool.Config().ConnString(), database.WithApplicationName("kvmesh-other"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	listen, err := pgx.ConnectConfig(t.Context(), pool.Config().ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = listen.Close(context.Background()) })
	if _, err := listen.Exec(t.Context(), "LISTEN "+database.OutboxChannel); err != nil {
		t.Fatal(err)
	}
	d := newDirect(t, pool, &fakePublisher{}, nil)
	commitDirect(t, pool, d, msg("k", "on commit")) // quiet
	enqueue(t, t.Context(), other, msg("j", "relayed"))
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	n, err := listen.WaitForNotification(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n.Payload != "kvmesh-other" {
		t.Errorf("first notification from %q, want kvmesh-other's: the commit of rows published on commit woke the relays", n.Payload)
	}
}

func TestDirectReleasesTheRestOfABatchAfterAStaleTransaction(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	const lease = 400 * time.Millisecond
	directPub, relayPub := &fakePublisher{}, &fakePublisher{}
	relay := startRelay(t, pool, relayPub, database.WithPollInterval(time.Hour))
	d := newDirect(t, pool, directPub, relay, database.WithDirectLease(lease))
	start := time.Now()
	stale := commitDirect(t, pool, d, msg("k", "stale"))
	for time.Since(start) < lease/2 { // the transaction ages past what may still be published
		time.Sleep(10 * time.Millisecond)
	}
	fresh := commitDirect(t, pool, d, msg("k", "fresh"))
	d.Committed(stale)
	d.Committed(fresh) // queued behind it: one batch when Run starts
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	waitFor(t, "the relay to publish both", func() bool { return len(relayPub.published()) == 2 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got, want := values(relayPub.published()), []string{"stale", "fresh"}; !slices.Equal(got, want) {
		t.Errorf("the relay published %v, want %v", got, want)
	}
	if n := len(directPub.published()); n != 0 {
		t.Errorf("published %d on commit, want none: the later row of the key must follow the released one", n)
	}
}
