"""A source that changes model is recorded, not silently overwritten.

One source id reused by two publishers of different models (a copied configuration, a
README example run twice) used to show only the latest model. Now:

- sources.previous_model / model_changed_at: the model the source spoke before its latest
  change of model, and the log time of the change (NULL when it never changed);
- source_status gains both (appended, so the view is replaced in place).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_STATUS = r"""
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
                  WHERE h.source = s.source), 0)::bigint AS lost_batches"""

_UPGRADE = (
    r"""
ALTER TABLE kvledger.sources ADD COLUMN previous_model text,
    ADD COLUMN model_changed_at timestamptz;

CREATE OR REPLACE VIEW kvledger.source_status AS"""
    + _STATUS
    + r""",
       s.previous_model, s.model_changed_at
FROM kvledger.sources s;
"""
)

_DOWNGRADE = (
    r"""
DROP VIEW kvledger.source_status;
CREATE VIEW kvledger.source_status AS"""
    + _STATUS
    + r"""
FROM kvledger.sources s;
ALTER TABLE kvledger.sources DROP COLUMN previous_model, DROP COLUMN model_changed_at;
"""
)


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
