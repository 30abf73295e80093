-- tenant_quotas holds each tenant's quota in the store, set by an operator
-- through the sender's PUT /v1/quotas/{tenant} (kvmesh quota set) and read
-- by every sender replica: at most max_bytes of values and max_keys keys
-- (NULL: unlimited). on_full says what a save that would go over does:
-- evict the tenant's own least recently used blocks, or skip the blocks
-- that do not fit (reason quota).
CREATE TABLE tenant_quotas (
    tenant     text PRIMARY KEY CHECK (tenant <> ''),
    max_bytes  bigint CHECK (max_bytes > 0),
    max_keys   bigint CHECK (max_keys > 0),
    on_full    text NOT NULL DEFAULT 'evict' CHECK (on_full IN ('evict', 'skip')),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CHECK (max_bytes IS NOT NULL OR max_keys IS NOT NULL)
);
