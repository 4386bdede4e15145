"""Records the log lost before the index read them, one row per loss.

A consumer whose stored offset is below its partition's first offset (retention deleted
records it never read) records the loss here, in the same transaction as ending the
residencies those records could have changed and moving its offset on
(consumer/log_loss.py): the group, the partition, the offsets lost, when, how many
residencies it ended and whose.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_UPGRADE = r"""
CREATE TABLE kvledger.log_losses (
    id                bigserial   PRIMARY KEY,
    consumer_group    text        NOT NULL,
    kafka_topic       text        NOT NULL,
    kafka_partition   integer     NOT NULL,
    first_lost_offset bigint      NOT NULL,
    last_lost_offset  bigint      NOT NULL CHECK (last_lost_offset >= first_lost_offset),
    detected_at       timestamptz NOT NULL DEFAULT now(),
    ended_residencies integer     NOT NULL DEFAULT 0,
    sources           text[]      NOT NULL DEFAULT '{}'
);
CREATE INDEX log_losses_partition_idx
    ON kvledger.log_losses (kafka_topic, kafka_partition, detected_at);
"""

_DOWNGRADE = r"""
DROP TABLE kvledger.log_losses;
"""


def upgrade() -> None:
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_DOWNGRADE)
