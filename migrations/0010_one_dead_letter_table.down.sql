-- Back to the sender's dead_letters and the scheduler's own table (0002,
-- 0003). The gpuworker's rows have no older home and are dropped.
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
INSERT INTO scheduler_dead_letters (topic, partition, "offset", key, reason, detail, payload, created_at)
SELECT topic, partition, "offset", record_key, reason, detail, payload, created_at
FROM dead_letters WHERE service = 'scheduler' ORDER BY id
ON CONFLICT DO NOTHING;
DELETE FROM dead_letters WHERE service <> 'sender';

DROP INDEX dead_letters_record_slot_idx;
DROP INDEX dead_letters_service_idx;
DROP INDEX dead_letters_reason_idx;
DROP INDEX dead_letters_engine_idx;
DROP INDEX dead_letters_request_idx;
CREATE UNIQUE INDEX dead_letters_record_slot_idx
    ON dead_letters (topic, partition, "offset", record_time, slot);
CREATE INDEX dead_letters_reason_idx ON dead_letters (reason, id);
CREATE INDEX dead_letters_engine_idx ON dead_letters (engine_id, id);
CREATE INDEX dead_letters_request_idx ON dead_letters (request_id, id);

ALTER TABLE dead_letters DROP COLUMN headers;
ALTER TABLE dead_letters DROP COLUMN record_key;
ALTER TABLE dead_letters DROP COLUMN service;
