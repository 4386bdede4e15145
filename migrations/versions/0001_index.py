"""The prefix-cache index: group specs, blocks, residencies, history, audit log, rejects,
consumer offsets and source health.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE SCHEMA IF NOT EXISTS kvledger;

        -- One row per KV-cache group of a model: declared by an operator or announced by
        -- producers. A declared spec wins over announcements.
        CREATE TABLE kvledger.group_specs (
            model           text        NOT NULL,
            group_idx       integer     NOT NULL,
            kind            text        NOT NULL,
            block_size      integer     NOT NULL CHECK (block_size > 0),
            hash_block_size integer     NOT NULL CHECK (hash_block_size > 0),
            sliding_window  integer,
            origin          text        NOT NULL CHECK (origin IN ('declared', 'announced')),
            announced_by    text,
            updated_at      timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (model, group_idx)
        );

        -- One row per block hash per (model, group). Hash i of a chunk event covers tokens
        -- [token_start + i*block_size, +block_size) and has hash i-1 as parent.
        -- Placeholders (sliding-window and similar groups) have block_size 0 and no tokens.
        CREATE TABLE kvledger.blocks (
            model        text        NOT NULL,
            group_idx    integer     NOT NULL,
            block_hash   bytea       NOT NULL,
            parent_hash  bytea,
            token_start  bigint,
            token_end    bigint,
            token_ids    integer[]   NOT NULL,
            block_size   integer     NOT NULL,
            partial      boolean     NOT NULL DEFAULT false,
            lora_name    text,
            extra_keys   text,
            first_seen   timestamptz NOT NULL,
            last_seen    timestamptz NOT NULL,
            PRIMARY KEY (model, group_idx, block_hash)
        );
        CREATE INDEX blocks_parent_idx ON kvledger.blocks (model, group_idx, parent_hash);

        -- Who holds a block, where: reference-counted (a hash can be announced several times
        -- for one holder); the row exists while refcount > 0. ownership '' = primary tier.
        CREATE TABLE kvledger.residencies (
            model        text        NOT NULL,
            group_idx    integer     NOT NULL,
            block_hash   bytea       NOT NULL,
            instance     text        NOT NULL,
            medium       text        NOT NULL,
            ownership    text        NOT NULL DEFAULT '',
            locality     text,
            since        timestamptz NOT NULL,
            kafka_topic     text     NOT NULL,
            kafka_partition integer  NOT NULL,
            kafka_offset    bigint   NOT NULL,
            refcount     integer     NOT NULL CHECK (refcount > 0),
            PRIMARY KEY (model, group_idx, block_hash, instance, medium, ownership)
        );
        CREATE INDEX residencies_instance_idx ON kvledger.residencies (instance, medium, ownership);

        -- One row per residency interval: opened when the count goes 0 -> 1, closed at 1 -> 0.
        CREATE TABLE kvledger.residency_history (
            id           bigserial   PRIMARY KEY,
            model        text        NOT NULL,
            group_idx    integer     NOT NULL,
            block_hash   bytea       NOT NULL,
            instance     text        NOT NULL,
            medium       text        NOT NULL,
            ownership    text        NOT NULL DEFAULT '',
            locality     text,
            stored_at    timestamptz NOT NULL,
            removed_at   timestamptz,
            removed_by   text CHECK (removed_by IN ('removed', 'cleared')),
            stored_partition integer NOT NULL,
            stored_offset    bigint  NOT NULL,
            CHECK (removed_at IS NULL OR removed_at >= stored_at)
        );
        CREATE INDEX residency_history_block_idx
            ON kvledger.residency_history (model, group_idx, block_hash, stored_at);
        CREATE UNIQUE INDEX residency_history_open_idx
            ON kvledger.residency_history (model, group_idx, block_hash, instance, medium, ownership)
            WHERE removed_at IS NULL;
        CREATE INDEX residency_history_instance_idx
            ON kvledger.residency_history (instance, stored_at);

        -- The audit log: one row per consumed message.
        CREATE TABLE kvledger.events (
            kafka_topic     text     NOT NULL,
            kafka_partition integer  NOT NULL,
            kafka_offset    bigint   NOT NULL,
            source       text,
            model        text,
            epoch        bigint,
            seq          bigint,
            event_type   text,
            group_idx    integer,
            medium       text,
            ownership    text,
            hash_count   integer     NOT NULL DEFAULT 0,
            noop_count   integer     NOT NULL DEFAULT 0,
            status       text        NOT NULL CHECK (status IN ('applied', 'rejected', 'duplicate')),
            reason       text,
            event_time   timestamptz,
            applied_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset)
        );
        CREATE INDEX events_source_idx ON kvledger.events (source, event_time);

        -- Rejected messages, raw bytes kept, replayable once the cause is fixed.
        CREATE TABLE kvledger.rejected_events (
            id              bigserial   PRIMARY KEY,
            kafka_topic     text        NOT NULL,
            kafka_partition integer     NOT NULL,
            kafka_offset    bigint      NOT NULL,
            kafka_key       bytea,
            raw             bytea       NOT NULL,
            reason          text        NOT NULL,
            detail          text        NOT NULL,
            source          text,
            first_seen      timestamptz NOT NULL DEFAULT now(),
            replayed_at     timestamptz,
            UNIQUE (kafka_topic, kafka_partition, kafka_offset)
        );
        CREATE INDEX rejected_events_reason_idx ON kvledger.rejected_events (reason);

        -- Where each consumer group stands: written in the same transaction as the index.
        CREATE TABLE kvledger.consumer_offsets (
            consumer_group  text        NOT NULL,
            kafka_topic     text        NOT NULL,
            kafka_partition integer     NOT NULL,
            next_offset     bigint      NOT NULL,
            updated_at      timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (consumer_group, kafka_topic, kafka_partition)
        );

        -- Per (source, model, group): the producer epoch and sequence seen, gaps counted.
        CREATE TABLE kvledger.source_health (
            source          text        NOT NULL,
            model           text        NOT NULL,
            group_idx       integer     NOT NULL,
            epoch           bigint      NOT NULL,
            last_seq        bigint      NOT NULL,
            gap_count       bigint      NOT NULL DEFAULT 0,
            missing_events  bigint      NOT NULL DEFAULT 0,
            epoch_changes   bigint      NOT NULL DEFAULT 0,
            duplicates      bigint      NOT NULL DEFAULT 0,
            last_event_time timestamptz,
            PRIMARY KEY (source, model, group_idx)
        );
        """
    )


def downgrade() -> None:
    op.execute("DROP SCHEMA IF EXISTS kvledger CASCADE")
