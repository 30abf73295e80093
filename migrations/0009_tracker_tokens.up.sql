-- Scheduler: the prompt token ids of a request, written once.
--
-- An engine may send the prompt's tokens of complete hash blocks with a
-- request's admitted event (RequestEvent.token_ids), so the BlockStored
-- KV events of its saves carry token_ids that token-keyed routers index.
-- The scheduler keeps them out of the tracker JSON that every event
-- rewrites: one row per request, written when the request is admitted
-- (and again only if a longer list arrives), 4 bytes a token
-- (little-endian uint32). The tracker row's `parts` records the count
-- (ledger.PartsMeta.tokens), which readers check the row against.
-- KVMESH_KV_EVENTS_TOKEN_IDS=false stores none.
CREATE TABLE tracker_tokens (
    engine_id  text  NOT NULL,
    request_id text  NOT NULL,
    tokens     bytea NOT NULL,
    PRIMARY KEY (engine_id, request_id),
    FOREIGN KEY (engine_id, request_id) REFERENCES trackers ON DELETE CASCADE
);

-- Token ids do not compress much; keep them out of line, uncompressed
-- (as the hash segments, 0007).
ALTER TABLE tracker_tokens ALTER COLUMN tokens SET STORAGE EXTERNAL;
