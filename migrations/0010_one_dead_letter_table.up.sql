-- One dead-letter table for every consuming service (pkg/deadletter).
--
-- dead_letters (0003, the sender's) gains the consuming service, the
-- original record's key and headers (so that a replay hands the record to
-- its handler as it was delivered); the scheduler's rows move in from
-- scheduler_dead_letters, which goes. A redelivered record still never adds
-- a second copy: the unique index now leads with the service, since two
-- services may consume the same record.
ALTER TABLE dead_letters ADD COLUMN service text NOT NULL DEFAULT 'sender';
ALTER TABLE dead_letters ALTER COLUMN service DROP DEFAULT;
ALTER TABLE dead_letters ADD COLUMN record_key text NOT NULL DEFAULT '';
ALTER TABLE dead_letters ADD COLUMN headers jsonb;

DROP INDEX dead_letters_record_slot_idx;
DROP INDEX dead_letters_reason_idx;
DROP INDEX dead_letters_engine_idx;
DROP INDEX dead_letters_request_idx;
CREATE UNIQUE INDEX dead_letters_record_slot_idx
    ON dead_letters (service, topic, partition, "offset", record_time, slot);
-- GET /v1/dlq of each service, newest first, and its filters.
CREATE INDEX dead_letters_service_idx ON dead_letters (service, id);
CREATE INDEX dead_letters_reason_idx ON dead_letters (service, reason, id);
CREATE INDEX dead_letters_engine_idx ON dead_letters (service, engine_id, id);
CREATE INDEX dead_letters_request_idx ON dead_letters (service, request_id, id);

-- The scheduler's rows: whole records (slot -1); their record time was not
-- kept, so the row's creation time stands in.
INSERT INTO dead_letters (service, reason, detail, payload, topic, partition, "offset",
    record_key, record_time, slot, created_at)
SELECT 'scheduler', reason, detail, COALESCE(payload, '\x'::bytea), topic, partition, "offset",
    key, created_at, -1, created_at
FROM scheduler_dead_letters ORDER BY id
ON CONFLICT DO NOTHING;
DROP TABLE scheduler_dead_letters;
