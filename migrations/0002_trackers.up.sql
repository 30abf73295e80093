-- Scheduler: one row per request (engine id, request id) holding its tracker.
-- tracker is the store connector's kvcore.Tracker (JSON); extras is the
-- scheduler's per-request state around it (the pd child's tracker, lookup
-- decisions not yet bound to an allocation, held events, outstanding task
-- ranges, per-group saved coverage, warnings).
CREATE TABLE trackers (
    engine_id   text        NOT NULL,
    request_id  text        NOT NULL,
    model       text        NOT NULL,
    state       text        NOT NULL,
    tracker     jsonb       NOT NULL,
    extras      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    last_seq    bigint      NOT NULL DEFAULT 0,
    error       text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    PRIMARY KEY (engine_id, request_id)
);

-- GET /v1/requests?state=… pages in key order within one state.
CREATE INDEX trackers_state_idx ON trackers (state, engine_id, request_id);

-- The retention purge deletes finished trackers by age.
CREATE INDEX trackers_finished_at_idx ON trackers (finished_at) WHERE finished_at IS NOT NULL;

-- Idempotency ledger: the ids of records already applied (kind is event,
-- decision or result), inserted in the transaction that applied them. Ids
-- are scoped by request, so producers need only make them unique per request.
CREATE TABLE processed_records (
    kind         text        NOT NULL,
    engine_id    text        NOT NULL,
    request_id   text        NOT NULL,
    id           text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, engine_id, request_id, id)
);

CREATE INDEX processed_records_at_idx ON processed_records (processed_at);

-- Records the scheduler could not apply (undecodable or invalid), kept for
-- operators; the consumer goes on.
CREATE TABLE scheduler_dead_letters (
    id          bigserial   PRIMARY KEY,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    "offset"    bigint      NOT NULL,
    key         text        NOT NULL DEFAULT '',
    reason      text        NOT NULL,
    detail      text        NOT NULL DEFAULT '',
    payload     bytea,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (topic, partition, "offset")
);
