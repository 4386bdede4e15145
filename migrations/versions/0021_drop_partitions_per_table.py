"""Partitions dropped one table at a time, each in a transaction of its own.

``kvledger.drop_table_partitions(p_history, p_audit, p_parent)`` drops the partitions of one
partitioned table (``p_parent``) that ended at or before its cut-off, deletes its default
partition's rows before it, and moves its retained window, as the two-argument form does for
every table at once. The retention pass calls it per table: a transaction that dropped one
table's partition (a moment's exclusive lock on that table) and then waited for another's,
which a consumer's batch held while it waited for the first, was a deadlock (seen in the
retention soak: PostgreSQL aborted one of them).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
CREATE FUNCTION kvledger.drop_table_partitions(p_history timestamptz, p_audit timestamptz,
                                               p_parent text)
RETURNS TABLE (parent text, partition text, lo timestamptz, hi timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_row record;
    v_cut timestamptz := CASE p_parent WHEN 'residency_history' THEN p_history ELSE p_audit END;
BEGIN
    IF p_parent NOT IN ('residency_history', 'events', 'rejected_events', 'decisions') THEN
        RAISE EXCEPTION 'not a partitioned table of kvledger: %', p_parent
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('kvledger.time_partitions'));
    FOR v_row IN
        SELECT t.parent, t.partition, t.lo, t.hi FROM kvledger.time_partitions t
        WHERE t.parent = p_parent AND t.hi <= v_cut ORDER BY t.lo
    LOOP
        EXECUTE format('DROP TABLE kvledger.%I', v_row.partition);
        DELETE FROM kvledger.time_partitions t WHERE t.partition = v_row.partition;
        INSERT INTO kvledger.retained_windows AS w (what, since) VALUES (v_row.parent, v_row.hi)
        ON CONFLICT (what) DO UPDATE SET since = greatest(w.since, EXCLUDED.since),
            updated_at = now();
        parent := v_row.parent; partition := v_row.partition; lo := v_row.lo; hi := v_row.hi;
        RETURN NEXT;
    END LOOP;
    EXECUTE format('DELETE FROM kvledger.%I WHERE %s < $1', p_parent || '_default',
                   kvledger.partition_key(p_parent)) USING v_cut;
END
$$;
"""
    )


def downgrade() -> None:
    op.execute("DROP FUNCTION kvledger.drop_table_partitions(timestamptz, timestamptz, text)")
