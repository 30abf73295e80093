package evictions

import (
	"context"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// DefaultLeaderPoll is how often a replica that does not lead tries to.
const DefaultLeaderPoll = 2 * time.Second

// PGLeader makes one sender replica of a deployment the watcher: the one
// holding a PostgreSQL session advisory lock named after the deployment's
// prefix and model. The lock is held on a connection taken out of the
// pool for as long as the replica leads; it goes with that session, so a
// replica that dies or loses its database connection stops leading and
// another takes over within Poll. Removals in the handover are a gap.
type PGLeader struct {
	pool *pgxpool.Pool
	key  int64
	// Poll is how often a replica tries to lead and a leader checks its
	// session (default DefaultLeaderPoll).
	Poll time.Duration
}

// NewPGLeader returns the leader election of kb's deployment over pool.
func NewPGLeader(pool *pgxpool.Pool, kb kvcore.KeyBuilder) *PGLeader {
	h := fnv.New64a()
	_, _ = h.Write([]byte("kvmesh-evictions\x00" + kb.Prefix + "\x00" + kb.Model))
	return &PGLeader{pool: pool, key: int64(h.Sum64()), Poll: DefaultLeaderPoll} // any 64 bits name the lock
}

// Lead implements Leader: it waits until this replica holds the lock and
// returns a context that ends when the lock's session fails or cancel is
// called, which releases the lock.
func (l *PGLeader) Lead(ctx context.Context) (context.Context, context.CancelFunc, error) {
	poll := l.Poll
	if poll <= 0 {
		poll = DefaultLeaderPoll
	}
	for {
		conn, err := l.tryLock(ctx)
		if err == nil && conn != nil {
			lead, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go l.hold(lead, cancel, conn, poll, done)
			return lead, func() { cancel(); <-done }, nil
		}
		if err := retry.Sleep(ctx, poll); err != nil {
			return nil, nil, fmt.Errorf("evictions: wait to lead: %w", err)
		}
	}
}

// tryLock takes a connection out of the pool and tries the lock on it; it
// returns the connection when it holds the lock, else closes it.
func (l *PGLeader) tryLock(ctx context.Context) (*pgx.Conn, error) {
	c, err := l.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("evictions: acquire lock connection: %w", err)
	}
	conn := c.Hijack()
	var got bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", l.key).Scan(&got); err != nil || !got {
		closeConn(conn)
		return nil, err
	}
	return conn, nil
}

// hold checks the lock's session every poll until lead ends, then closes
// the session, which releases the lock.
func (l *PGLeader) hold(lead context.Context, cancel context.CancelFunc, conn *pgx.Conn, poll time.Duration, done chan<- struct{}) {
	defer close(done)
	defer closeConn(conn)
	defer cancel()
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-lead.Done():
			return
		case <-t.C:
			ctx, stop := context.WithTimeout(lead, poll)
			err := conn.Ping(ctx)
			stop()
			if err != nil {
				return
			}
		}
	}
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}
