// Package quotas keeps every tenant within its quota in the store. Its
// Table is the tenant_quotas table's only reader and writer (an operator
// sets a quota through the sender's PUT /v1/quotas/{tenant}); its
// Enforcer holds the quotas in memory, admits each save's new keys
// against its tenant's usage, removes the tenant's own least recently used
// blocks to make room or skips what does not fit, and shows each tenant's
// usage on /metrics.
//
// Usage is read from the store-time indexes of the tenant's namespaces
// (kvstore.StoreTimes: one entry per key a gpuworker stored), so it counts
// every replica's and every engine's saves of the tenant; a value's size is
// its group's bytes per block plus the value's frame. Saves of the tenant
// in flight on this replica are reserved until their puts are answered;
// two replicas admitting saves of one tenant at the same instant can go
// over by what they admit at once, and the next save evicts it back.
package quotas

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Sentinel errors.
var (
	// ErrInvalid reports a quota that cannot be set.
	ErrInvalid = errors.New("quotas: invalid quota")
	// ErrNotFound reports a tenant with no quota.
	ErrNotFound = errors.New("quotas: no quota for the tenant")
)

// Quota is one tenant's quota (adminapi.TenantQuota).
type Quota = adminapi.TenantQuota

// Validate checks q as an operator sets it: a valid, non-empty tenant, at
// least one positive bound, no negative one, and OnFull evict, skip or
// empty (evict).
func Validate(q Quota) error {
	if q.Tenant == "" {
		return fmt.Errorf("%w: a quota is per tenant; the tenant-less key space has none", ErrInvalid)
	}
	if err := kvcore.ValidateTenant(q.Tenant); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if q.MaxBytes < 0 || q.MaxKeys < 0 || q.MaxBytes == 0 && q.MaxKeys == 0 {
		return fmt.Errorf("%w: max_bytes %d and max_keys %d: set at least one, both non-negative (0: unlimited)", ErrInvalid, q.MaxBytes, q.MaxKeys)
	}
	switch q.OnFull {
	case "", adminapi.QuotaEvict, adminapi.QuotaSkip:
		return nil
	default:
		return fmt.Errorf("%w: on_full %q is not %q or %q", ErrInvalid, q.OnFull, adminapi.QuotaEvict, adminapi.QuotaSkip)
	}
}

// Table reads and writes tenant_quotas.
type Table struct {
	pool *pgxpool.Pool
}

// NewTable returns the table on pool.
func NewTable(pool *pgxpool.Pool) *Table { return &Table{pool: pool} }

const listSQL = `SELECT tenant, coalesce(max_bytes, 0), coalesce(max_keys, 0), on_full, updated_at FROM tenant_quotas ORDER BY tenant`

const setSQL = `
INSERT INTO tenant_quotas (tenant, max_bytes, max_keys, on_full, updated_at)
VALUES ($1, nullif($2, 0), nullif($3, 0), $4, now())
ON CONFLICT (tenant) DO UPDATE SET max_bytes = excluded.max_bytes, max_keys = excluded.max_keys,
	on_full = excluded.on_full, updated_at = excluded.updated_at
RETURNING updated_at`

const deleteSQL = `DELETE FROM tenant_quotas WHERE tenant = $1`

// List returns every quota, by tenant.
func (t *Table) List(ctx context.Context) ([]Quota, error) {
	rows, err := t.pool.Query(ctx, listSQL)
	if err != nil {
		return nil, fmt.Errorf("quotas: list: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Quota, error) {
		var q Quota
		err := row.Scan(&q.Tenant, &q.MaxBytes, &q.MaxKeys, &q.OnFull, &q.UpdatedAt)
		q.UpdatedAt = q.UpdatedAt.UTC()
		return q, err
	})
	if err != nil {
		return nil, fmt.Errorf("quotas: list: %w", err)
	}
	return out, nil
}

// Set validates q and writes it, replacing the tenant's quota; it returns
// q as stored (OnFull filled, UpdatedAt the write's time).
func (t *Table) Set(ctx context.Context, q Quota) (Quota, error) {
	if err := Validate(q); err != nil {
		return Quota{}, err
	}
	if q.OnFull == "" {
		q.OnFull = adminapi.QuotaEvict
	}
	var at time.Time
	if err := t.pool.QueryRow(ctx, setSQL, q.Tenant, q.MaxBytes, q.MaxKeys, q.OnFull).Scan(&at); err != nil {
		return Quota{}, fmt.Errorf("quotas: set %q: %w", q.Tenant, err)
	}
	q.UpdatedAt = at.UTC()
	return q, nil
}

// Delete removes tenant's quota; a tenant without one is ErrNotFound.
func (t *Table) Delete(ctx context.Context, tenant string) error {
	tag, err := t.pool.Exec(ctx, deleteSQL, tenant)
	if err != nil {
		return fmt.Errorf("quotas: delete %q: %w", tenant, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", ErrNotFound, tenant)
	}
	return nil
}
