-- Publish on commit (database.Direct): the process that committed outbox
-- rows publishes them itself right after COMMIT, instead of waking a relay
-- that claims them again. While it may, the rows carry its name and a
-- lease; no relay claims them before the lease ends, and later rows of the
-- same (topic, key) wait behind them, so the order per key holds. A
-- process that crashed, or could not publish and released its rows
-- (publish_after set to NULL), leaves them to the relays as before.
--
-- publish_owner: the Direct that may publish the row (NULL: relays only).
-- publish_after: until when only publish_owner may publish it (NULL: any
-- relay now).
ALTER TABLE outbox
    ADD COLUMN publish_owner text,
    ADD COLUMN publish_after timestamptz;

-- Both the relay's claim (is an earlier row of this key still waiting?)
-- and Direct's insert (may this row be published on commit?) look up the
-- pending rows of one (topic, key); this index holds exactly those rows,
-- and replaces the index of backed-off ones, a subset of them.
DROP INDEX outbox_backoff_idx;
CREATE INDEX outbox_pending_key_idx ON outbox (topic, key, id)
    WHERE sent_at IS NULL AND failed_at IS NULL;

-- A transaction whose rows its own process publishes on commit sets
-- kvmesh.outbox_quiet, local to the transaction (Direct's insert does), so
-- that its commit wakes no relay: the process wakes its own relay for any
-- row it leaves to the relays.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('kvmesh.outbox_quiet', true), '') <> 'on' THEN
        PERFORM pg_notify('kvmesh_outbox', coalesce(current_setting('application_name', true), ''));
    END IF;
    RETURN NULL;
END;
$$;
