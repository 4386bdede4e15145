-- kvledger.match_prefix_at as of the newest migration, as PostgreSQL prints it (pg_get_functiondef).
-- A revision that changes it freezes its own copy and updates this file; a test compares.
CREATE OR REPLACE FUNCTION kvledger.match_prefix_at(p_model text, p_group integer, p_hashes bytea[], p_at timestamp with time zone, p_granularity text DEFAULT 'block'::text)
 RETURNS TABLE(instance text, medium text, ownership text, matched_blocks integer, matched_tokens bigint)
 LANGUAGE plpgsql
 STABLE
AS $function$
        DECLARE
            v_ratio integer;
            v_hash_size integer;
        BEGIN
            IF p_at < (SELECT w.since FROM kvledger.retained_windows w
                       WHERE w.what = 'residency_history') THEN
                RAISE EXCEPTION 'the residency history before % is not retained: ask for a time at or after it',
                    (SELECT w.since FROM kvledger.retained_windows w
                     WHERE w.what = 'residency_history')
                    USING ERRCODE = 'invalid_parameter_value',
                          HINT = 'kvledger consume --history-retention sets how long it is kept';
            END IF;
            IF p_granularity = 'block' THEN
                RETURN QUERY WITH held AS MATERIALIZED (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership, runs.n::integer, b.token_end
            FROM runs
            LEFT JOIN kvledger.blocks b
              ON b.model = p_model AND b.group_idx = p_group AND b.block_hash = p_hashes[runs.n];
                RETURN;
            ELSIF p_granularity IS DISTINCT FROM 'hash' THEN
                RAISE EXCEPTION 'granularity must be block or hash, not %', p_granularity
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT s.block_size / s.hash_block_size, s.hash_block_size
              INTO v_ratio, v_hash_size
              FROM kvledger.group_specs s
             WHERE s.model = p_model AND s.group_idx = p_group
               AND s.hash_block_size > 0 AND s.block_size > 0
               AND s.block_size % s.hash_block_size = 0;
            IF NOT FOUND THEN
                RETURN;  -- no spec with a hash size: nothing can be matched by hash
            END IF;
            RETURN QUERY WITH held AS MATERIALIZED (
                SELECT DISTINCT h.instance, h.medium, h.ownership, c.i
                FROM (
                SELECT DISTINCT r.instance, r.medium, r.ownership, q.i::integer AS i
                FROM unnest(p_hashes) WITH ORDINALITY AS q(h, i)
                JOIN kvledger.residency_history r
                  ON r.model = p_model AND r.group_idx = p_group AND r.block_hash = q.h
                 AND r.stored_at <= p_at AND (r.removed_at IS NULL OR r.removed_at > p_at)) h CROSS JOIN LATERAL generate_series(
                    CASE WHEN h.i % v_ratio = 0 THEN h.i - v_ratio + 1 ELSE h.i END,
                    h.i) AS c(i)),
            agg AS (
                SELECT held.instance, held.medium, held.ownership, count(*) AS c,
                       min(held.i) AS lo, max(held.i) AS hi
                FROM held
                GROUP BY held.instance, held.medium, held.ownership
            ),
            gapped AS (
                SELECT held.instance, held.medium, held.ownership, held.i,
                       row_number() OVER (PARTITION BY held.instance, held.medium,
                                          held.ownership ORDER BY held.i) AS rn
                FROM held
                JOIN agg ON agg.instance = held.instance AND agg.medium = held.medium
                        AND agg.ownership = held.ownership
                WHERE agg.lo = 1 AND agg.c <> agg.hi
            ),
            runs AS (
                SELECT agg.instance, agg.medium, agg.ownership, agg.hi AS n
                FROM agg WHERE agg.lo = 1 AND agg.c = agg.hi
                UNION ALL
                SELECT gapped.instance, gapped.medium, gapped.ownership, max(gapped.i)
                FROM gapped WHERE gapped.i = gapped.rn
                GROUP BY gapped.instance, gapped.medium, gapped.ownership
            )
            SELECT runs.instance, runs.medium, runs.ownership,
                   (runs.n / v_ratio)::integer, runs.n::bigint * v_hash_size
            FROM runs;
        END
        $function$
