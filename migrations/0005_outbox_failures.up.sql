-- Outbox rows that cannot be published no longer block the relay.
--
-- next_attempt_at: a row whose publish failed transiently is retried no
-- earlier than this (per-row exponential backoff). Later rows of the same
-- (topic, key) wait behind it, so the order per key is kept; rows of other
-- keys keep flowing.
--
-- failed_at, fail_reason: a row the broker can never accept (larger than the
-- maximum message size, an invalid topic, ...) is marked failed with a
-- reason code; the relay skips it from then on and the scheduler's admin API
-- lists it (GET /v1/outbox/failed) until an operator retries it.
ALTER TABLE outbox
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN failed_at       timestamptz,
    ADD COLUMN fail_reason     text;

-- The relay scans pending rows (neither sent nor failed) in id order.
DROP INDEX outbox_unsent_idx;
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE sent_at IS NULL AND failed_at IS NULL;

-- The claim query looks up backed-off rows by (topic, key); only rows that
-- failed transiently and are still pending are in this index.
CREATE INDEX outbox_backoff_idx ON outbox (topic, key, id)
    WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at IS NOT NULL;

-- GET /v1/outbox/failed pages through failed rows in id order.
CREATE INDEX outbox_failed_idx ON outbox (id) WHERE failed_at IS NOT NULL AND sent_at IS NULL;
