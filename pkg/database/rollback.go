package database

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// rollbackWithin bounds Rollback.
const rollbackWithin = 5 * time.Second

// Rollback ends the transaction a failed pipelined batch (BEGIN … COMMIT
// queued as statements on one acquired connection) left open on conn,
// within a few seconds whatever the caller's context. Should the ROLLBACK
// fail too, the pool destroys conn on release, since it is not idle, so
// nothing half-written can ever commit.
func Rollback(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), rollbackWithin)
	defer cancel()
	_, _ = conn.Exec(ctx, "ROLLBACK")
}
