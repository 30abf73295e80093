-- Sender: dead letters and per-task save outcomes.
--
-- dead_letters holds every save group or record the sender could not store:
-- invalid groups (a kvcore reason code), undecodable records, tasks whose
-- handler panicked, and transient failures that outlived their retries. It
-- keeps the original record so an operator can replay it.
CREATE TABLE dead_letters (
    id            bigserial   PRIMARY KEY,
    reason        text        NOT NULL,
    detail        text        NOT NULL DEFAULT '',
    -- group_index is the KV group the entry is about; NULL for a whole record.
    group_index   integer,
    task_id       text        NOT NULL DEFAULT '',
    engine_id     text        NOT NULL DEFAULT '',
    request_id    text        NOT NULL DEFAULT '',
    payload       bytea       NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    -- record_time is the Kafka record's timestamp: with topic, partition and
    -- offset it identifies one delivery of one record, even across a broker
    -- that was reset and reuses offsets.
    record_time   timestamptz NOT NULL,
    -- slot numbers the dead letters of one record (-1: the whole record).
    slot          integer     NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    replay_status text        NOT NULL DEFAULT 'none'
        CHECK (replay_status IN ('none', 'replayed', 'invalid', 'failed')),
    replay_count  integer     NOT NULL DEFAULT 0,
    replayed_at   timestamptz,
    replay_result jsonb
);

-- A redelivered record never adds a second copy of its dead letters.
CREATE UNIQUE INDEX dead_letters_record_slot_idx
    ON dead_letters (topic, partition, "offset", record_time, slot);
-- GET /v1/dlq filters, newest first.
CREATE INDEX dead_letters_reason_idx ON dead_letters (reason, id);
CREATE INDEX dead_letters_engine_idx ON dead_letters (engine_id, id);
CREATE INDEX dead_letters_request_idx ON dead_letters (request_id, id);

-- save_outcomes holds one row per save task the sender completed: the
-- accounting (every task exactly once) and the idempotency key of the
-- handler (a redelivered task whose row exists publishes nothing new).
CREATE TABLE save_outcomes (
    task_id              text        PRIMARY KEY,
    result_id            text        NOT NULL,
    engine_id            text        NOT NULL,
    request_id           text        NOT NULL,
    status               text        NOT NULL
        CHECK (status IN ('stored', 'skipped', 'dead_lettered', 'failed')),
    groups_stored        integer     NOT NULL DEFAULT 0,
    groups_existing      integer     NOT NULL DEFAULT 0,
    groups_skipped       integer     NOT NULL DEFAULT 0,
    groups_dead_lettered integer     NOT NULL DEFAULT 0,
    groups_failed        integer     NOT NULL DEFAULT 0,
    keys_stored          integer     NOT NULL DEFAULT 0,
    keys_existing        integer     NOT NULL DEFAULT 0,
    keys_skipped         integer     NOT NULL DEFAULT 0,
    keys_dead_lettered   integer     NOT NULL DEFAULT 0,
    keys_failed          integer     NOT NULL DEFAULT 0,
    bytes                bigint      NOT NULL DEFAULT 0,
    topic                text        NOT NULL,
    partition            integer     NOT NULL,
    "offset"             bigint      NOT NULL,
    result               jsonb       NOT NULL,
    created_at           timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX save_outcomes_request_idx ON save_outcomes (engine_id, request_id);
