DROP INDEX IF EXISTS trackers_load_deadline_idx;
ALTER TABLE trackers DROP COLUMN IF EXISTS load_deadline;
