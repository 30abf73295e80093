-- Scheduler: a deadline for the ranks of a multi-rank load.
--
-- A load task of a multi-rank engine (tensor parallel etc.) is finished
-- only when every one of its ranks reported. load_deadline is the earliest
-- deadline of the request's loads still waiting for ranks (now plus
-- KVMESH_LOAD_RANK_TIMEOUT when the load was first stored), NULL when none
-- waits. The scheduler's maintenance loop finds the overdue requests
-- through the partial index and finishes their loads fail-closed (every
-- block a load error, the silent ranks named in missing_ranks).
ALTER TABLE trackers ADD COLUMN load_deadline timestamptz;

CREATE INDEX trackers_load_deadline_idx ON trackers (load_deadline) WHERE load_deadline IS NOT NULL;
