"""Batches a relay could not recover from its engine (EventsLost).

- residency_history.removed_by and lifecycle_events.kind also take 'lost': the source's
  residencies in the group, every tier and ownership, ended because the relay lost engine
  batches that may have changed any of them.
- lifecycle_events.first_lost_seq / last_lost_seq: the engine's batch numbers lost.
- source_health.lost_gaps / lost_batches: per stream, how often and how much.
- source_status gains lost_gaps and lost_batches (appended, so the view is replaced in place).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_UPGRADE = r"""
ALTER TABLE kvledger.residency_history DROP CONSTRAINT residency_history_removed_by_check;
ALTER TABLE kvledger.residency_history ADD CONSTRAINT residency_history_removed_by_check
    CHECK (removed_by IN ('removed', 'cleared', 'restart', 'closed', 'lost'));
ALTER TABLE kvledger.lifecycle_events DROP CONSTRAINT lifecycle_events_kind_check;
ALTER TABLE kvledger.lifecycle_events ADD CONSTRAINT lifecycle_events_kind_check
    CHECK (kind IN ('restart', 'closed', 'lost'));
ALTER TABLE kvledger.lifecycle_events ADD COLUMN first_lost_seq bigint,
    ADD COLUMN last_lost_seq bigint;
ALTER TABLE kvledger.source_health ADD COLUMN lost_gaps bigint NOT NULL DEFAULT 0,
    ADD COLUMN lost_batches bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE VIEW kvledger.source_status AS
SELECT s.source, s.model, kvledger.source_state(s.source) AS state, s.epoch, s.last_seen,
       s.closed_at, s.heartbeat_ms, s.restarts,
       (SELECT max(l.event_time) FROM kvledger.lifecycle_events l
         WHERE l.source = s.source AND l.kind = 'restart') AS last_restart,
       coalesce((SELECT sum(h.gap_count) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS gaps,
       coalesce((SELECT sum(h.missing_events) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS missing_events,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'GPU') AS held_gpu,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'CPU') AS held_cpu,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'STORAGE') AS held_storage,
       coalesce((SELECT sum(h.lost_gaps) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS lost_gaps,
       coalesce((SELECT sum(h.lost_batches) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS lost_batches
FROM kvledger.sources s;
"""

_DOWNGRADE = r"""
DROP VIEW kvledger.source_status;
CREATE VIEW kvledger.source_status AS
SELECT s.source, s.model, kvledger.source_state(s.source) AS state, s.epoch, s.last_seen,
       s.closed_at, s.heartbeat_ms, s.restarts,
       (SELECT max(l.event_time) FROM kvledger.lifecycle_events l
         WHERE l.source = s.source AND l.kind = 'restart') AS last_restart,
       coalesce((SELECT sum(h.gap_count) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS gaps,
       coalesce((SELECT sum(h.missing_events) FROM kvledger.source_health h
                  WHERE h.source = s.source), 0)::bigint AS missing_events,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'GPU') AS held_gpu,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'CPU') AS held_cpu,
       (SELECT count(*) FROM kvledger.residencies r
         WHERE r.instance = s.source AND r.medium = 'STORAGE') AS held_storage
FROM kvledger.sources s;
ALTER TABLE kvledger.source_health DROP COLUMN lost_gaps, DROP COLUMN lost_batches;
ALTER TABLE kvledger.lifecycle_events DROP COLUMN first_lost_seq, DROP COLUMN last_lost_seq;
DELETE FROM kvledger.lifecycle_events WHERE kind = 'lost';
ALTER TABLE kvledger.lifecycle_events DROP CONSTRAINT lifecycle_events_kind_check;
ALTER TABLE kvledger.lifecycle_events ADD CONSTRAINT lifecycle_events_kind_check
    CHECK (kind IN ('restart', 'closed'));
UPDATE kvledger.residency_history SET removed_by = 'cleared' WHERE removed_by = 'lost';
ALTER TABLE kvledger.residency_history DROP CONSTRAINT residency_history_removed_by_check;
ALTER TABLE kvledger.residency_history ADD CONSTRAINT residency_history_removed_by_check
    CHECK (removed_by IN ('removed', 'cleared', 'restart', 'closed'));
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
