"""When a topic counts as under-replicated for its settings, and the replication kvledger
gives a topic it creates (kvledger.schemas.replication, no broker)."""

from __future__ import annotations

import pytest

from kvledger.schemas.replication import (
    TopicReplication,
    default_replication,
    replication_problem,
)


def state(
    replicas: int, in_sync: int, min_insync: int, brokers: int, partition: int = 0
) -> TopicReplication:
    return TopicReplication("kv-events", replicas, in_sync, min_insync, brokers, partition)


@pytest.mark.parametrize(
    ("replicas", "in_sync", "min_insync", "brokers"),
    [
        (1, 1, 1, 1),  # the local single broker
        (2, 2, 1, 2),  # two brokers, one may go
        (3, 3, 2, 3),  # the production setting
        (3, 2, 2, 3),  # one broker away: writes go on, nothing to say yet
        (3, 3, 2, 5),  # more brokers than replicas
        (3, 3, 3, 3),  # as many as there are brokers: strict, but nothing to spare
    ],
)
def test_settings_with_room_for_them_say_nothing(
    replicas: int, in_sync: int, min_insync: int, brokers: int
) -> None:
    assert replication_problem(state(replicas, in_sync, min_insync, brokers)) is None


def test_fewer_replicas_than_min_insync_refuses_every_write() -> None:
    said = replication_problem(state(1, 1, 2, 1))
    assert said is not None
    assert "replication factor 1 is below its min.insync.replicas=2" in said
    assert "every write with acks=all is refused" in said
    assert said.startswith("topic 'kv-events' is under-replicated: ")


def test_no_replica_to_spare_is_said_where_the_cluster_has_room() -> None:
    said = replication_problem(state(2, 2, 2, 3))
    assert said is not None and "leaves no broker to lose" in said
    # One replica on two brokers: min.insync 1 + 1 > 1.
    said = replication_problem(state(1, 1, 1, 2))
    assert said is not None and "leaves no broker to lose" in said


def test_too_few_in_sync_replicas_names_the_partition() -> None:
    said = replication_problem(state(3, 1, 2, 3, partition=7))
    assert said is not None
    assert "partition 7 has 1 of 3 replicas in sync, fewer than min.insync.replicas=2" in said


def test_one_replica_on_three_brokers_is_said_once_with_every_reason() -> None:
    said = replication_problem(state(1, 1, 1, 3))
    assert said is not None
    assert "replication factor 1 on a cluster of 3 brokers" in said
    assert "leaves no broker to lose" in said
    assert said.count("topic 'kv-events'") == 1


@pytest.mark.parametrize(
    ("brokers", "replicas", "min_insync"),
    [(1, 1, None), (2, 2, None), (3, 3, "2"), (6, 3, "2")],
)
def test_default_replication_follows_the_cluster(
    brokers: int, replicas: int, min_insync: str | None
) -> None:
    got, config = default_replication(brokers, {"retention.ms": "1000"})
    assert got == replicas
    assert config.get("min.insync.replicas") == min_insync
    assert config["retention.ms"] == "1000"


def test_a_min_insync_the_caller_set_is_kept() -> None:
    assert default_replication(3, {"min.insync.replicas": "3"}) == (
        3,
        {"min.insync.replicas": "3"},
    )
    assert default_replication(0) == (1, {})  # no broker listed: one replica asked
