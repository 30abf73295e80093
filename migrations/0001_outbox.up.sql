-- Transactional outbox: services insert messages here in the same transaction
-- as their state change; database.Relay publishes them to Kafka in id order.
CREATE TABLE outbox (
    id         bigserial   PRIMARY KEY,
    topic      text        NOT NULL,
    key        text        NOT NULL DEFAULT '',
    value      bytea,
    headers    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz,
    attempts   integer     NOT NULL DEFAULT 0,
    last_error text
);

-- The relay scans unsent rows in id order; this index stays as small as the backlog.
CREATE INDEX outbox_unsent_idx ON outbox (id) WHERE sent_at IS NULL;

-- PurgeSent deletes sent rows by age.
CREATE INDEX outbox_sent_at_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Wake relays when rows are committed. Notifications are delivered at commit
-- and duplicates within one transaction are folded into one.
CREATE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('kvmesh_outbox', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
