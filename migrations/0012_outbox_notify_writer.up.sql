-- Say who committed outbox rows: the notification's payload is the writing
-- session's application_name (kvmesh-scheduler, kvmesh-sender, ...), so a
-- relay wakes for its own service's rows only, instead of every relay of
-- every service waking for every commit (pkg/database/listen.go). Rows of a
-- service none of whose relays runs are still claimed by any relay's poll.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('kvmesh_outbox', coalesce(current_setting('application_name', true), ''));
    RETURN NULL;
END;
$$;
