package database

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// CountInto adds the (name, count) rows that sql returns to into: the
// shape of every "SELECT x, count(*) … GROUP BY x" a service reports.
func CountInto(ctx context.Context, pool *pgxpool.Pool, into map[string]int64, sql string, args ...any) error {
	rows, err := pool.Query(ctx, sql, args...)
	if err != nil {
		return fmt.Errorf("count: %w", err)
	}
	var name string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&name, &n}, func() error {
		into[name] = n
		return nil
	}); err != nil {
		return fmt.Errorf("count: %w", err)
	}
	return nil
}
