-- block_removals is the sender's log of the store's removals: one row per
-- BlockRemoved record its removal watcher published (the blocks of one
-- store namespace that left for one cause), so an operator can ask what of
-- a tenant was removed, when, why and how old it was (GET /v1/removals).
-- Written once, never updated; rows older than the retention are deleted.
--
-- cause: evicted, expired or del (Redis's event), or flushed: the whole
-- store was found flushed (an AllBlocksCleared; namespace is the
-- deployment's scope, blocks 0: how many left is not known). ages_known of
-- the blocks had a store time; age_*_s sum up their ages in seconds (NULL
-- when none).
CREATE TABLE block_removals (
    id          bigserial PRIMARY KEY,
    removed_at  timestamptz NOT NULL,
    model       text NOT NULL,
    fingerprint text NOT NULL,
    tenant      text NOT NULL DEFAULT '',
    namespace   text NOT NULL,
    cause       text NOT NULL,
    blocks      integer NOT NULL CHECK (blocks >= 0),
    ages_known  integer NOT NULL CHECK (ages_known >= 0 AND ages_known <= blocks),
    age_min_s   double precision,
    age_max_s   double precision,
    age_sum_s   double precision
);

CREATE INDEX block_removals_tenant_time_idx ON block_removals (tenant, removed_at);
CREATE INDEX block_removals_time_idx ON block_removals (removed_at);
