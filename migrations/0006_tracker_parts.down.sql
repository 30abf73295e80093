-- Fold the segments back into the tracker JSON (the chain into
-- block_hashes, the store tracker's table into block_table, the pd
-- tracker's chain prefix and table into extras.pd), then drop them.
UPDATE trackers t SET tracker = t.tracker
    || jsonb_build_object('block_hashes', coalesce((
        SELECT jsonb_agg(u.h ORDER BY s.start, u.n)
        FROM tracker_hashes s CROSS JOIN LATERAL unnest(s.hashes) WITH ORDINALITY AS u(h, n)
        WHERE s.engine_id = t.engine_id AND s.request_id = t.request_id), '[]'::jsonb))
    || jsonb_build_object('block_table', (
        SELECT jsonb_agg(coalesce((
            SELECT jsonb_agg(CASE WHEN b.v < 0 THEN 'null'::jsonb ELSE to_jsonb(b.v) END ORDER BY s.start, b.n)
            FROM tracker_blocks s CROSS JOIN LATERAL unnest(s.blocks) WITH ORDINALITY AS b(v, n)
            WHERE s.engine_id = t.engine_id AND s.request_id = t.request_id AND s.slot = 0
              AND s.gen = (t.parts->'slots'->0->>'gen')::int AND s.grp = g.i - 1), '[]'::jsonb) ORDER BY g.i)
        FROM generate_series(1, jsonb_array_length(t.parts->'slots'->0->'lens')) AS g(i)))
WHERE t.parts IS NOT NULL AND jsonb_typeof(t.parts->'slots'->0->'lens') = 'array';

UPDATE trackers t SET tracker = t.tracker
    || jsonb_build_object('block_hashes', coalesce((
        SELECT jsonb_agg(u.h ORDER BY s.start, u.n)
        FROM tracker_hashes s CROSS JOIN LATERAL unnest(s.hashes) WITH ORDINALITY AS u(h, n)
        WHERE s.engine_id = t.engine_id AND s.request_id = t.request_id), '[]'::jsonb))
WHERE t.parts IS NOT NULL AND jsonb_typeof(t.parts->'slots'->0->'lens') IS DISTINCT FROM 'array';

UPDATE trackers t SET extras = jsonb_set(t.extras, '{pd}', t.extras->'pd'
    || jsonb_build_object('block_hashes', coalesce((
        SELECT jsonb_agg(h ORDER BY n) FROM (
            SELECT u.h, row_number() OVER (ORDER BY s.start, u.n) AS n
            FROM tracker_hashes s CROSS JOIN LATERAL unnest(s.hashes) WITH ORDINALITY AS u(h, n)
            WHERE s.engine_id = t.engine_id AND s.request_id = t.request_id) c
        WHERE c.n <= (t.parts->>'pd_hashes')::int), '[]'::jsonb))
    || jsonb_build_object('block_table', (
        SELECT jsonb_agg(coalesce((
            SELECT jsonb_agg(CASE WHEN b.v < 0 THEN 'null'::jsonb ELSE to_jsonb(b.v) END ORDER BY s.start, b.n)
            FROM tracker_blocks s CROSS JOIN LATERAL unnest(s.blocks) WITH ORDINALITY AS b(v, n)
            WHERE s.engine_id = t.engine_id AND s.request_id = t.request_id AND s.slot = 1
              AND s.gen = (t.parts->'slots'->1->>'gen')::int AND s.grp = g.i - 1), '[]'::jsonb) ORDER BY g.i)
        FROM generate_series(1, jsonb_array_length(t.parts->'slots'->1->'lens')) AS g(i))))
WHERE t.parts IS NOT NULL AND t.extras ? 'pd' AND jsonb_typeof(t.parts->'slots'->1->'lens') = 'array'
  AND coalesce((t.parts->>'pd_hashes')::int, 0) >= 0;

DROP TABLE tracker_blocks;
DROP TABLE tracker_hashes;
ALTER TABLE trackers DROP COLUMN parts;
