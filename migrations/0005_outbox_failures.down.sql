DROP INDEX IF EXISTS outbox_failed_idx;
DROP INDEX IF EXISTS outbox_backoff_idx;
DROP INDEX IF EXISTS outbox_pending_idx;
CREATE INDEX IF NOT EXISTS outbox_unsent_idx ON outbox (id) WHERE sent_at IS NULL;
ALTER TABLE outbox
    DROP COLUMN IF EXISTS fail_reason,
    DROP COLUMN IF EXISTS failed_at,
    DROP COLUMN IF EXISTS next_attempt_at;
