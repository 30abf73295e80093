-- Back to 0012: every commit notifies, relays alone publish.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('kvmesh_outbox', coalesce(current_setting('application_name', true), ''));
    RETURN NULL;
END;
$$;

DROP INDEX IF EXISTS outbox_pending_key_idx;
CREATE INDEX outbox_backoff_idx ON outbox (topic, key, id)
    WHERE sent_at IS NULL AND failed_at IS NULL AND next_attempt_at IS NOT NULL;

ALTER TABLE outbox
    DROP COLUMN IF EXISTS publish_after,
    DROP COLUMN IF EXISTS publish_owner;
