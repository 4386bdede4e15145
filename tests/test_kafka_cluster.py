"""kvledger on a three-broker cluster (`KVLEDGER_KAFKA_BROKERS=3 scripts/services up kafka`):
the topics it creates have three replicas and min.insync.replicas 2, the brokers' own
defaults match, and a topic under-replicated for its settings is warned of once, by the
commands too; with a cluster of the test's own, a broker away and a lost quorum are said,
and no acknowledged record is lost.

The cluster: $KVLEDGER_KAFKA_CLUSTER_BOOTSTRAP (the ``env`` line of a running one), or
``start`` there (or CI=true) for one started here on free ports with its own state folder
(about 20 s on two cores). Without either the module is skipped, saying so.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, OffsetSpec

from kvledger.schemas.replication import warn_under_replicated
from kvledger.schemas.topics import ensure_topic
from tests.helpers.consuming import consumer_process
from tests.helpers.exactly_once import assert_exactly_once, producer_process
from tests.helpers.kafka import consume_all
from tests.helpers.procs import free_ports

pytestmark = pytest.mark.integration
SERVICES = str(Path(__file__).resolve().parents[1] / "scripts" / "services")
ENV = "KVLEDGER_KAFKA_CLUSTER_BOOTSTRAP"


@dataclass
class Cluster:
    bootstrap: str
    env: dict[str, str] | None = None  # scripts/services' settings, where the test owns it
    state: Path | None = None

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def services(self, *words: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.env is not None
        return subprocess.run(
            [SERVICES, *words],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=check,
        )

    def stop_node(self, node: int, sig: int = signal.SIGTERM) -> None:
        """Stop one node (SIGTERM: as an operator would; SIGKILL: a crash), and wait until it
        has gone."""
        assert self.state is not None
        pidfile = next(self.state.glob(f"kafka-*-x3/node-{node}/kafka.pid"))
        pid = int(pidfile.read_text())
        os.kill(pid, sig)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        raise AssertionError(f"node {node} (pid {pid}) did not stop in 60 s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    given = os.environ.get(ENV, "")
    if given and given != "start":
        yield Cluster(given)
        return
    if given != "start" and os.environ.get("CI", "").lower() != "true":
        pytest.skip(f"needs a three-broker cluster: set {ENV} to its bootstrap list, or to 'start'")
    state = tmp_path_factory.mktemp("kafka-cluster")
    base = free_ports(6)
    env = dict(
        os.environ,
        KVLEDGER_KAFKA_BROKERS="3",
        KVLEDGER_STATE_DIR=str(state),
        KVLEDGER_KAFKA_PORT=str(base),
        KVLEDGER_KAFKA_CONTROLLER_PORT=str(base + 3),
    )
    bootstrap = ",".join(f"127.0.0.1:{base + i}" for i in range(3))
    owned = Cluster(bootstrap, env, state)
    try:
        owned.services("up", "kafka")
        printed = owned.services("env").stdout
        assert f"export KVLEDGER_KAFKA_BOOTSTRAP={bootstrap}\n" in printed, printed
        yield owned
    finally:
        subprocess.run([SERVICES, "down", "kafka"], env=env, check=False, timeout=120)


def _name(what: str) -> str:
    return f"t_cluster_{what}_{uuid.uuid4().hex[:8]}"


def _replicas(admin: AdminClient, topic: str) -> list[tuple[int, int]]:
    """(replicas, in sync) of each partition."""
    meta = admin.list_topics(topic, timeout=10).topics[topic]
    return [(len(p.replicas), len(p.isrs)) for p in meta.partitions.values()]


def _settled(admin: AdminClient, topic: str, want: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``_replicas`` once it is ``want``, or as it stands after 30 s: a new topic's followers
    join its in-sync set a moment after it is made (longer on a loaded machine)."""
    deadline = time.monotonic() + 30
    while (got := _replicas(admin, topic)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def _config(admin: AdminClient, kind: ConfigResource.Type, name: str) -> dict[str, str]:
    resource = ConfigResource(kind, name)
    entries = admin.describe_configs([resource])[resource].result(timeout=10)
    return {key: entry.value for key, entry in entries.items()}


def test_kvledger_topics_and_the_brokers_defaults_keep_three_copies(cluster: Cluster) -> None:
    admin = cluster.admin()
    deadline = time.monotonic() + 30
    while len(admin.list_topics(timeout=10).brokers) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # every node registered (a loaded machine takes a moment)
    assert len(admin.list_topics(timeout=10).brokers) == 3
    topic = _name("events")
    assert ensure_topic(admin, topic, 6)
    assert _settled(admin, topic, [(3, 3)] * 6) == [(3, 3)] * 6
    assert _config(admin, ConfigResource.Type.TOPIC, topic)["min.insync.replicas"] == "2"
    # A topic made with the cluster's defaults (replication -1, as the dead-letter topic's):
    # three copies there too; and the brokers' own internal topics.
    other = _name("defaults")
    assert ensure_topic(admin, other, 2, replication_factor=-1, exact_partitions=False)
    assert _settled(admin, other, [(3, 3)] * 2) == [(3, 3)] * 2
    broker = _config(admin, ConfigResource.Type.BROKER, "1")
    assert {
        k: broker[k]
        for k in (
            "default.replication.factor",
            "min.insync.replicas",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
            "transaction.state.log.min.isr",
        )
    } == {
        "default.replication.factor": "3",
        "min.insync.replicas": "2",
        "offsets.topic.replication.factor": "3",
        "transaction.state.log.replication.factor": "3",
        "transaction.state.log.min.isr": "2",
    }
    assert warn_under_replicated(cluster.bootstrap, {}, [topic, other]) == []


def test_an_under_replicated_topic_is_warned_of_once(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    admin = cluster.admin()
    single, strict = _name("single"), _name("strict")
    ensure_topic(admin, single, 3, replication_factor=1)
    # The bad input of issue 74: replication 1 under min.insync.replicas=2.
    ensure_topic(admin, strict, 3, replication_factor=1, config={"min.insync.replicas": "2"})
    with caplog.at_level(logging.WARNING, "kvledger.schemas.replication"):
        said = warn_under_replicated(cluster.bootstrap, {}, [single, strict, _name("missing")])
        again = warn_under_replicated(cluster.bootstrap, {}, [single, strict])
    assert len(said) == 2 and again == []
    assert [r.getMessage() for r in caplog.records] == said
    by_topic = {s.split("'")[1]: s for s in said}
    assert "replication factor 1 on a cluster of 3 brokers" in by_topic[single]
    assert (
        "below its min.insync.replicas=2: every write with acks=all is refused"
        in (by_topic[strict])
    )


def test_a_command_says_it_at_start_up(cluster: Cluster) -> None:
    """`kvledger simulate` on a topic with one replica: one warning line, then it runs."""
    topic = _name("simulate")
    ensure_topic(cluster.admin(), topic, 3, replication_factor=1)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvledger",
            "simulate",
            "--bootstrap",
            cluster.bootstrap,
            "--topic",
            topic,
            "--partitions",
            "3",
            "--instances",
            "1",
            "--requests",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(Path(SERVICES).parents[1])),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "is under-replicated" in line]
    assert len(warned) == 1 and "WARNING" in warned[0], done.stderr[-3000:]
    assert f"topic '{topic}'" in warned[0]


def test_a_broker_away_and_a_lost_quorum_are_said_and_lose_nothing(cluster: Cluster) -> None:
    if cluster.env is None:
        pytest.skip(f"stops brokers: only on a cluster of the test's own ({ENV}=start)")
    admin = cluster.admin()
    topic = _name("strict3")
    ensure_topic(admin, topic, 3, config={"min.insync.replicas": "3"})
    producer = Producer(
        {
            "bootstrap.servers": cluster.bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "log_level": 0,
        }
    )
    for i in range(30):
        producer.produce(topic, key=f"k{i % 3}".encode(), value=str(i).encode())
    assert producer.flush(30) == 0
    del producer
    # One broker away: every partition is down to two replicas in sync, fewer than three.
    cluster.stop_node(3)
    deadline = time.monotonic() + 30
    while any(isr > 2 for _, isr in _replicas(admin, topic)) and time.monotonic() < deadline:
        time.sleep(0.5)
    said = warn_under_replicated(cluster.bootstrap, {}, [topic])
    assert len(said) == 1 and "of 3 replicas in sync, fewer than min.insync.replicas=3" in said[0]
    status = cluster.services("status", check=False).stdout
    assert "node 3 stopped" in status and "2 of 3 brokers" in status, status
    # Two away: no quorum; status says what is missing and `up` waits for it.
    cluster.stop_node(2)
    status = cluster.services("status", check=False)
    assert "no controller quorum: 1 of 3 voters run, 2 are needed" in status.stdout, status
    assert status.returncode == 3
    with pytest.raises(KafkaException, match=r"did not create topic .* lost their quorum"):
        ensure_topic(admin, _name("no_quorum"), 1, timeout=5)
    started = time.monotonic()
    up = cluster.services("up", "kafka")
    assert "kafka ready" in up.stderr, up.stderr
    print(f"two nodes back in {time.monotonic() - started:.1f} s", file=sys.stderr)
    # Nothing acknowledged was lost.
    got = consume_all(cluster.bootstrap, topic, _name("group"), 30)
    assert sorted(int(m.value()) for m in got) == list(range(30))


# ---------------------------------------------------------------- faults under load
# A steady simulated fleet publishing through the producer library (the plugin's path:
# idempotent, acks=all) and the consumer writing PostgreSQL run while brokers die and return;
# after each test every message is audited exactly once, no source saw a gap or a duplicate,
# and the index equals a rebuild from the log. Each fault is repeated three times.

REPEATS = 3


def _back(cluster: Cluster, topic: str) -> float:
    """Start the missing node again and wait until every partition has three replicas in
    sync; the seconds that took."""
    started = time.monotonic()
    cluster.services("up", "kafka")
    want = [(3, 3)] * 6
    assert _settled(cluster.admin(), topic, want) == want
    return time.monotonic() - started


def _busiest_leader(admin: AdminClient, topic: str) -> int:
    """The node leading the partition with the most records."""
    deadline = time.monotonic() + 60
    while True:  # a leader just moved: a stale epoch is refused until the metadata catches up
        partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
        ask = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
        try:
            ends = {tp.partition: f.result().offset for tp, f in admin.list_offsets(ask).items()}
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        busiest = max(ends, key=ends.__getitem__)
        return int(partitions[busiest].leader)


def _coordinator(cluster: Cluster, group: str) -> int:
    """The node coordinating ``group``, asked again by a fresh client while a move is under
    way (a client keeps asking the coordinator it found first)."""
    deadline = time.monotonic() + 60
    while True:
        admin = cluster.admin()
        try:
            described = admin.describe_consumer_groups([group])[group].result(timeout=30)
            return int(described.coordinator.id)
        except KafkaException as exc:
            print(f"coordinator of {group}: {exc}", file=sys.stderr)
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _active_controller(cluster: Cluster) -> int:
    """The quorum's leader, as the nodes' own quorum-state files say (the newest epoch)."""
    assert cluster.state is not None
    best = (-1, -1)
    for path in cluster.state.glob("kafka-*-x3/node-*/data/__cluster_metadata-0/quorum-state"):
        state = json.loads(path.read_text())
        if state.get("leaderId", -1) >= 0:
            best = max(best, (int(state.get("leaderEpoch", 0)), int(state["leaderId"])))
    assert best[1] > 0, "no node names a quorum leader"
    return best[1]


@pytest.fixture
def loaded(cluster: Cluster, fresh_database: str) -> Iterator[tuple[str, str, str]]:
    """(topic, database, group) with the fleet publishing and the consumer running; after
    the test body: both finished, and everything checked."""
    if cluster.env is None:
        pytest.skip(f"stops brokers: only on a cluster of the test's own ({ENV}=start)")
    cluster.services("up", "kafka")  # every node (an earlier test stops some)
    admin = cluster.admin()
    topic, group = _name("faults"), _name("group")
    ensure_topic(admin, topic, 6)
    producer = producer_process(cluster.bootstrap, topic, requests=500, rate=700)
    consumer = consumer_process(cluster.bootstrap, fresh_database, topic, group, False)
    try:
        time.sleep(3)  # steady
        yield topic, fresh_database, group
        caught_up = assert_exactly_once(
            cluster.bootstrap, fresh_database, topic, group, producer, consumer, 600
        )
        print(f"caught up {caught_up:.1f} s after the fleet", file=sys.stderr)
    finally:
        for proc in (producer, consumer):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        admin.delete_topics([topic, f"{topic}.dlq"])


def test_the_busiest_leader_killed_and_back_loses_and_repeats_nothing(
    cluster: Cluster, loaded: tuple[str, str, str]
) -> None:
    topic = loaded[0]
    for _ in range(REPEATS):
        node = _busiest_leader(cluster.admin(), topic)
        cluster.stop_node(node, signal.SIGKILL)
        time.sleep(2)  # the fleet and the consumer go on with two
        print(f"leader {node} back in sync in {_back(cluster, topic):.1f} s", file=sys.stderr)


def test_the_active_controller_killed_and_back(
    cluster: Cluster, loaded: tuple[str, str, str]
) -> None:
    topic = loaded[0]
    for _ in range(REPEATS):
        node = _active_controller(cluster)
        cluster.stop_node(node, signal.SIGKILL)
        time.sleep(2)
        print(f"controller {node} back in sync in {_back(cluster, topic):.1f} s", file=sys.stderr)


def test_a_rolling_restart_of_every_broker(cluster: Cluster, loaded: tuple[str, str, str]) -> None:
    topic = loaded[0]
    for _ in range(REPEATS):
        for node in (1, 2, 3):
            cluster.stop_node(node, signal.SIGTERM)
            print(f"node {node} restarted in {_back(cluster, topic):.1f} s", file=sys.stderr)


def test_the_consumer_groups_coordinator_killed_while_it_commits(
    cluster: Cluster, loaded: tuple[str, str, str]
) -> None:
    """A broker's loss moves the group's coordinator: the consumer rejoins (its offsets are
    in PostgreSQL's transaction, so nothing is applied twice)."""
    topic, _, group = loaded
    for _ in range(REPEATS):
        node = _coordinator(cluster, group)
        cluster.stop_node(node, signal.SIGKILL)
        time.sleep(3)
        print(f"coordinator {node} back in {_back(cluster, topic):.1f} s", file=sys.stderr)
