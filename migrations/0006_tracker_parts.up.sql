-- Scheduler: a tracker's parts that grow with the prompt are written once.
--
-- A request's hash chain and block tables used to live inside the tracker
-- JSON, so every engine event rewrote them (156 KB of JSON at 32K tokens).
-- They are append-only, so they now live in segment tables written once:
-- an event inserts only the hashes and block ids it adds, and the tracker
-- row keeps the small mutable state plus `parts`, the lengths of what the
-- segments hold (ledger.PartsMeta), which readers check their cache against.
--
-- A tracker row written before this migration still carries its chain and
-- table inline with `parts` NULL; the scheduler reads those as they are and
-- moves them into segments the first time it updates the row.
ALTER TABLE trackers ADD COLUMN parts jsonb;

-- tracker_hashes: the hash chain (hex), in segments starting at `start`.
CREATE TABLE tracker_hashes (
    engine_id  text    NOT NULL,
    request_id text    NOT NULL,
    start      integer NOT NULL CHECK (start >= 0),
    hashes     text[]  NOT NULL,
    PRIMARY KEY (engine_id, request_id, start),
    FOREIGN KEY (engine_id, request_id) REFERENCES trackers ON DELETE CASCADE
);

-- tracker_blocks: the block table of one tracker slot (0 the store
-- connector, 1 the pd child) in generation gen (a new or resumed step
-- replaces the table: a new generation), one KV group's block ids from
-- index `start` (-1 is a null block). Rows of older generations are deleted
-- when a new one is written.
CREATE TABLE tracker_blocks (
    engine_id  text     NOT NULL,
    request_id text     NOT NULL,
    slot       smallint NOT NULL CHECK (slot >= 0),
    gen        integer  NOT NULL CHECK (gen >= 0),
    grp        smallint NOT NULL CHECK (grp >= 0),
    start      integer  NOT NULL CHECK (start >= 0),
    blocks     bigint[] NOT NULL,
    PRIMARY KEY (engine_id, request_id, slot, gen, grp, start),
    FOREIGN KEY (engine_id, request_id) REFERENCES trackers ON DELETE CASCADE
);
