"""Answers no choice was reported for: Dynamo's ``/query`` answers as decision rows.

A router that asks kvledger as Dynamo's indexer chooses an instance after the answer and
tells nobody, so its answer is recorded (what each worker was offered, hence *available*)
with no chosen instance:

- ``kvledger.decisions``: ``chosen``, ``chosen_state`` and ``captured_blocks`` may be NULL,
  and are, together, exactly in such rows (a check says so);
- ``kvledger.decision_outcomes``: their outcome is ``unreported``, decided first (nothing
  captured or delivered is known of them);
- ``kvledger.decision_funnel``: its decisions and block sums count the decisions with a
  chosen instance only, so captured over available stays a routing's ratio; a new column,
  ``unreported``, counts the answers (in rows whose instance is NULL), and
  ``unreported_available_blocks`` sums what they offered.

Downgrading deletes the answer rows (the older schema cannot hold them).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

# Each outcome's count, as decision_funnel's columns.
_OUTCOME_NAMES = ("no_holder", "holder_silent", "chosen_elsewhere", "lower_tier_only",
                  "evicted_before_arrival", "captured")  # fmt: skip


def _counts(outcomes: tuple[str, ...]) -> str:
    return ",\n".join(f"       count(*) FILTER (WHERE outcome = '{o}') AS {o}" for o in outcomes)


_OUTCOMES = r"""
CREATE OR REPLACE VIEW kvledger.decision_outcomes AS
SELECT d.decision_id, d.decided_at, d.recorded_at, d.model, d.group_idx, d.request_id,
       d.origin, d.chosen, d.chosen_state, d.block_size, d.prompt_blocks,
       d.available_blocks, d.available_tier, d.captured_blocks, d.captured_tier,
       d.silent_blocks, del.delivered_blocks,
       CASE
           WHEN d.chosen IS NULL THEN 'unreported'
           WHEN d.available_blocks = 0 AND d.silent_blocks = 0 THEN 'no_holder'
           WHEN d.available_blocks = 0 THEN 'holder_silent'
           WHEN d.captured_blocks < d.available_blocks THEN 'chosen_elsewhere'
           WHEN d.captured_tier IS DISTINCT FROM 'GPU' THEN 'lower_tier_only'
           WHEN del.delivered_blocks < d.captured_blocks THEN 'evicted_before_arrival'
           ELSE 'captured'
       END AS outcome,
       d.offered
FROM kvledger.decisions d
CROSS JOIN LATERAL (
    SELECT CASE WHEN d.captured_hashes IS NULL THEN NULL ELSE coalesce((
        SELECT min(array_position(d.captured_hashes, h.block_hash)) - 1
        FROM kvledger.residency_history h
        WHERE h.model = d.model AND h.group_idx = d.group_idx AND h.instance = d.chosen
          AND h.medium = 'GPU' AND h.ownership = ''
          AND h.block_hash = ANY (d.captured_hashes)
          AND h.stored_at > d.decided_at
          AND h.stored_at <= d.decided_at + interval '1 minute'
    ), d.captured_blocks) END AS delivered_blocks
) del;
"""

_UPGRADE = (
    r"""
ALTER TABLE kvledger.decisions ALTER COLUMN chosen DROP NOT NULL,
    ALTER COLUMN chosen_state DROP NOT NULL,
    ALTER COLUMN captured_blocks DROP NOT NULL,
    ADD CONSTRAINT decisions_chosen_whole CHECK (
        (chosen IS NULL) = (chosen_state IS NULL) AND (chosen IS NULL) = (captured_blocks IS NULL)
    );
"""
    + _OUTCOMES
    + r"""
CREATE OR REPLACE VIEW kvledger.decision_funnel AS
SELECT date_trunc('minute', decided_at) AS minute, model, chosen AS instance,
       count(*) FILTER (WHERE chosen IS NOT NULL) AS decisions,
       coalesce(sum(prompt_blocks) FILTER (WHERE chosen IS NOT NULL), 0) AS prompt_blocks,
       coalesce(sum(available_blocks) FILTER (WHERE chosen IS NOT NULL), 0) AS available_blocks,
       coalesce(sum(captured_blocks), 0) AS captured_blocks,
       sum(delivered_blocks) AS delivered_blocks,
       count(delivered_blocks) AS delivered_known,
""" + _counts(_OUTCOME_NAMES + ("unreported",)) + """,
       coalesce(sum(available_blocks) FILTER (WHERE chosen IS NULL), 0)
           AS unreported_available_blocks
FROM kvledger.decision_outcomes
GROUP BY 1, 2, 3;
"""
)

# 0018's views, for the way down.
_DOWNGRADE = r"""
DELETE FROM kvledger.decisions WHERE chosen IS NULL;
DROP VIEW kvledger.decision_funnel;
DROP VIEW kvledger.decision_outcomes;
ALTER TABLE kvledger.decisions DROP CONSTRAINT decisions_chosen_whole,
    ALTER COLUMN chosen SET NOT NULL,
    ALTER COLUMN chosen_state SET NOT NULL,
    ALTER COLUMN captured_blocks SET NOT NULL;
""" + _OUTCOMES.replace("           WHEN d.chosen IS NULL THEN 'unreported'\n", "") + r"""
CREATE VIEW kvledger.decision_funnel AS
SELECT date_trunc('minute', decided_at) AS minute, model, chosen AS instance,
       count(*) AS decisions,
       sum(prompt_blocks) AS prompt_blocks,
       sum(available_blocks) AS available_blocks,
       sum(captured_blocks) AS captured_blocks,
       sum(delivered_blocks) AS delivered_blocks,
       count(delivered_blocks) AS delivered_known,
""" + _counts(_OUTCOME_NAMES) + """
FROM kvledger.decision_outcomes
GROUP BY 1, 2, 3;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
