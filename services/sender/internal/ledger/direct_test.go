package ledger_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// recorder is a database.Publisher that keeps what it is asked to publish.
type recorder struct {
	mu   sync.Mutex
	msgs []bus.Message
}

func (r *recorder) Publish(_ context.Context, msgs ...bus.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msgs...)
	return nil
}

func (r *recorder) keys() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.msgs))
	for i, m := range r.msgs {
		out[i] = m.Topic + "/" + string(m.Value)
	}
	return out
}

// runDirect runs a Direct on pool (no relay) until the test ends.
func runDirect(t *testing.T, pool *pgxpool.Pool, pub database.Publisher) *database.Direct {
	t.Helper()
	d, err := database.NewDirect(pool, pub, nil)
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, d.Run)
	return d
}

// TestCommitPublishesOnCommit: with a Direct, every commit path (one
// statement, a group of concurrent lanes, the dead-letter transaction)
// publishes its messages right after COMMIT — each task's once, in order,
// from leased rows that end sent — and a redelivered task publishes
// nothing again.
func TestCommitPublishesOnCommit(t *testing.T) {
	pool := dbtest.NewPool(t)
	pub := &recorder{}
	l := ledger.New(pool, ledger.WithDirect(runDirect(t, pool, pub)))
	ctx := context.Background()
	clean := func(id string, off int64) ledger.Entry {
		e := taskEntry(id, off)
		e.Outcome.Result.Status = "stored"
		e.Messages = append(e.Messages, bus.Message{Topic: contract.TopicKVEvents, Key: "ns", Value: []byte(`"` + id + `"`)})
		return e
	}
	if _, err := l.Commit(ctx, clean("one", 1)); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 8 { // lanes committing at once: grouped
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := l.Commit(ctx, clean(fmt.Sprintf("g%d", i), int64(10+i))); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	dl := deadletter.DeadLetter{Reason: "table_group_count", Group: group(1), Slot: 0}
	if _, err := l.Commit(ctx, taskEntry("dead", 30, dl)); err != nil {
		t.Fatal(err)
	}
	if c, err := l.Commit(ctx, clean("one", 40)); err != nil || !c.Done {
		t.Fatalf("redelivered task: %+v, %v; want done", c, err)
	}
	const want = 2 + 8*2 + 2 // results and kv events; the dead task's result and its DLQ record
	deadline := time.Now().Add(15 * time.Second)
	for {
		var rows, leased, unsent int
		err := pool.QueryRow(ctx, `SELECT count(*), count(publish_owner), count(*) FILTER (WHERE sent_at IS NULL) FROM outbox`).Scan(&rows, &leased, &unsent)
		if err != nil {
			t.Fatal(err)
		}
		if rows == want && leased == want && unsent == 0 && len(pub.keys()) == want {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("outbox: %d rows, %d leased, %d unsent, %d published; want %d, all leased, sent and published once", rows, leased, unsent, len(pub.keys()), want)
		}
		time.Sleep(5 * time.Millisecond) // poll interval, not synchronisation
	}
	got := pub.keys()
	rows, _ := pool.Query(ctx, `SELECT topic || '/' || convert_from(value, 'UTF8') FROM outbox ORDER BY id`)
	stored, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if slices.Sort(got); !slices.Equal(got, slices.Sorted(slices.Values(stored))) {
		t.Errorf("published %v, want the outbox's rows once each %v", got, stored)
	}
}
