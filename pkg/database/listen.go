package database

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/retry"
)

// listener holds a dedicated connection (outside the pool, so it takes no
// pool slot) that LISTENs on OutboxChannel. When it has no connection the
// relay still works, by polling.
//
// A notification's payload names the session that committed the rows (its
// application_name, migration 0012): the listener wakes for its own
// service's commits and for unnamed ones, and lets other services' relays
// answer theirs, so that one commit wakes one service's relays rather than
// every relay of the mesh.
type listener struct {
	pool  *pgxpool.Pool
	log   *slog.Logger
	retry time.Duration // pause after losing the connection
	conn  *pgx.Conn
	self  string // the pool's application_name
}

// newListener is the listener of a relay on pool.
func newListener(pool *pgxpool.Pool, log *slog.Logger, retry time.Duration) *listener {
	return &listener{pool: pool, log: log, retry: retry, self: pool.Config().ConnConfig.RuntimeParams["application_name"]}
}

// ownCommit reports whether a notification with payload is for the relay
// of application self: it names self, or nobody (a commit of a session
// without a name, or of a database migrated before 0012).
func ownCommit(self, payload string) bool {
	return payload == "" || self == "" || payload == self
}

// ensure (re)connects and LISTENs if the listener has no connection. Rows
// committed before LISTEN takes effect are found by the batch that follows.
func (l *listener) ensure(ctx context.Context) {
	if l.conn != nil {
		return
	}
	conn, err := pgx.ConnectConfig(ctx, l.pool.Config().ConnConfig)
	if err == nil {
		_, err = conn.Exec(ctx, "LISTEN "+OutboxChannel)
		if err != nil {
			_ = conn.Close(ctx)
		}
	}
	if err != nil {
		if ctx.Err() == nil {
			l.log.WarnContext(ctx, "outbox relay: listen failed; polling", "err", err)
		}
		return
	}
	l.conn = conn
}

// wait returns when a notification of the relay's own commits arrives or
// kick receives (reporting true), after d, or when ctx is done; after
// losing its connection it returns within retry, so that the next ensure
// reconnects.
func (l *listener) wait(ctx context.Context, d time.Duration, kick <-chan struct{}) bool {
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	kicked := make(chan struct{})
	go func() { // ends with the wait (the deferred cancel)
		select {
		case <-kick:
			close(kicked)
			cancel()
		case <-wctx.Done():
		}
	}()
	if l.conn == nil {
		<-wctx.Done() // a cancelled ctx ends the relay loop
		return isClosed(kicked)
	}
	for {
		n, err := l.conn.WaitForNotification(wctx)
		switch {
		case isClosed(kicked):
			return true
		case err == nil && !ownCommit(l.self, n.Payload):
			continue // another service's relays answer it
		case err == nil:
			l.drain()
			return true
		case ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded):
			return false
		}
		l.log.WarnContext(ctx, "outbox relay: listen connection lost; reconnecting", "err", err)
		l.close()
		_ = retry.Sleep(ctx, min(l.retry, d))
		return false
	}
}

// drain drops the notifications the connection has already received: they
// are for commits made before now, which the batch the caller runs next
// sees, so one batch answers them all instead of one empty batch each.
// Notifications still unread on the socket wake the next wait.
func (l *listener) drain() {
	done, cancel := context.WithCancel(context.Background())
	cancel()
	for {
		if _, err := l.conn.WaitForNotification(done); err != nil {
			return // none left: a done context ends the wait before any read
		}
	}
}

// isClosed reports whether c is closed.
func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// close drops the listening connection.
func (l *listener) close() {
	if l.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = l.conn.Close(ctx)
	l.conn = nil
}
