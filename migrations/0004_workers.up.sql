-- Worker registry: every gpuworker process (one per engine id and rank)
-- registers its data-plane base URL and GPU inventory, then heartbeats.
-- The sender and pd loads find an engine's live workers here.
CREATE TABLE workers (
    engine_id     text        NOT NULL,
    tp            integer     NOT NULL CHECK (tp >= 0),
    pcp           integer     NOT NULL CHECK (pcp >= 0),
    dcp           integer     NOT NULL CHECK (dcp >= 0),
    pp            integer     NOT NULL CHECK (pp >= 0),
    addr          text        NOT NULL,
    devices       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    registered_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (engine_id, tp, pcp, dcp, pp)
);
