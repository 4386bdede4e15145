"""kvledger against a real schema registry: Apicurio Registry 3.3.3 through its Confluent
API (``/apis/ccompat/v7``), as ``scripts/services up registry`` runs it.

Publishing registers the envelope schema under each subject strategy and the consumer
applies every event; the released envelopes (0.2.0, then 0.3.0's) evolve under one subject
with BACKWARD compatibility; a registry killed while events are published and consumed
loses none; a schema id the registry does not know is dead-lettered with its reason, and a
registry address that is not one is a clear error, never a dead letter.

Each test makes its own topics, consumer groups, database and subjects, and removes them.
The outage test runs a registry of its own (own port and state folder) to kill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from kvledger import settings
from kvledger.consumer.db import connect
from kvledger.fleet import FleetConfig
from kvledger.schemas.codec import (
    Codec,
    envelope_schema_json,
    released_schemas,
    schema_fingerprint,
)
from kvledger.schemas.errors import DecodeError
from kvledger.schemas.events import Envelope, Heartbeat
from kvledger.schemas.registry import (
    STRATEGIES,
    RegistryUnavailableError,
    SchemaIncompatibleError,
    open_registry,
    subject_for,
)
from kvledger.serving.router.index import RouterIndex
from kvledger.simulate_cmd import run_simulation
from tests.helpers.kafka import consume_all
from tests.helpers.procs import free_port, spawn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SERVICES = str(ROOT / "scripts" / "services")
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
CONFLUENT_API = "/apis/ccompat/v7"


# ------------------------------------------------------------------ the registry itself
def start_registry(env: Mapping[str, str]) -> str:
    """``scripts/services up registry`` (idempotent; fetches it on first use) with ``env``;
    returns the URL ``scripts/services env`` then exports. Under CI a registry that cannot
    start fails the test; elsewhere it skips, saying why."""
    try:
        done = subprocess.run(
            [SERVICES, "up", "registry"], env=env, capture_output=True, text=True,
            timeout=900, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        _unavailable(f"scripts/services up registry took over {exc.timeout} s")
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if "error:" in line]
        _unavailable((said or done.stderr.splitlines() or ["no output"])[-1])
    url = exports(env).get(settings.ENV_REGISTRY)
    assert url and url.endswith(CONFLUENT_API), f"`env` printed no registry: {url!r}"
    return url


def _unavailable(why: str) -> None:
    message = f"the schema registry is not available: {why}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def exports(env: Mapping[str, str]) -> dict[str, str]:
    """What ``scripts/services env`` exports with ``env``."""
    printed = subprocess.run(
        [SERVICES, "env"], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return dict(
        line.removeprefix("export ").split("=", 1) for line in printed.splitlines() if "=" in line
    )


def call(url: str, method: str = "GET", body: Any = None) -> Any:
    """One request to the registry's Confluent API; its JSON answer."""
    request = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read() or b"null")


@pytest.fixture(scope="module")
def registry_url() -> str:
    """The Confluent API of the registry scripts/services runs (started here if it is not)."""
    return start_registry(os.environ)


@pytest.fixture
def subjects(registry_url: str) -> Iterator[list[str]]:
    """Subjects a test names here are deleted afterwards, for good (and their rules)."""
    made: list[str] = []
    yield made
    for subject in made:
        for method, path in (
            ("DELETE", f"/config/{subject}"),
            ("DELETE", f"/subjects/{subject}"),
            ("DELETE", f"/subjects/{subject}?permanent=true"),
        ):
            with contextlib.suppress(urllib.error.HTTPError):
                call(registry_url + path, method)
    if made:
        left = set(call(registry_url + "/subjects?deleted=true"))
        assert not left & set(made), f"subjects left in the registry: {left & set(made)}"


@pytest.fixture
def groups(kafka_admin: AdminClient) -> Iterator[Callable[[str], str]]:
    """``groups(name)``: a consumer group of this test's alone, deleted afterwards."""
    made: list[str] = []

    def make(name: str) -> str:
        made.append(f"test-{name}-{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield make
    if made:
        for future in kafka_admin.delete_consumer_groups(made).values():
            with contextlib.suppress(Exception):
                future.result(timeout=30)


@pytest.fixture
def topic(make_topic: Callable[..., str], kafka_admin: AdminClient) -> Iterator[str]:
    """A topic of this test's, and its dead-letter topic (made by the consumer) removed."""
    name = make_topic("registry", partitions=3)
    yield name
    for future in kafka_admin.delete_topics([f"{name}.dlq"]).values():
        with contextlib.suppress(Exception):
            future.result(timeout=30)


def registry_args(url: str, strategy: str | None = None) -> argparse.Namespace:
    """The registry options as the commands parse them."""
    return argparse.Namespace(
        schema_registry=url, schema_registry_config=None, subject_strategy=strategy
    )


# ------------------------------------------------------------------ publish and consume
def publish(bootstrap: str, topic: str, codec: Codec, seed: int) -> int:
    """A simulated fleet of two engines through the producer library; the messages acked."""
    fleet = FleetConfig(instances=2, requests=8, seed=seed)
    result = run_simulation(bootstrap, topic, fleet, partitions=3, show_progress=False, codec=codec)
    assert result.acked == result.produced > 0
    return result.acked


def consume_command(bootstrap: str, db: str, topic: str, group: str, registry: str) -> list[str]:
    """``kvledger consume`` until caught up, reading the registry's framing."""
    return [
        sys.executable, "-m", "kvledger.cli", "consume", "--bootstrap", bootstrap,
        "--database-url", db, "--topic", topic, "--consumer-group", group,
        "--dlq-topic", f"{topic}.dlq", "--batch-timeout", "0.2", "--no-migrate",
        "--until-caught-up", "--schema-registry", registry,
    ]  # fmt: skip


def consume(bootstrap: str, db: str, topic: str, group: str, registry: str) -> str:
    done = subprocess.run(
        consume_command(bootstrap, db, topic, group, registry),
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def audit(db: str, topic: str) -> dict[str, int]:
    """Per status (applied, rejected, duplicate), the topic's messages the index recorded;
    fails where one was recorded twice."""
    with connect(db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT status, count(*) FROM kvledger.events WHERE kafka_topic = %s GROUP BY 1",
            (topic,),
        ).fetchall()
        (twice,) = conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM kvledger.events WHERE kafka_topic = %s "
            "GROUP BY kafka_partition, kafka_offset HAVING count(*) > 1) AS t",
            (topic,),
        ).fetchone() or (0,)
    assert twice == 0, f"{twice} messages recorded more than once"
    return dict(rows)


def rejected(db: str, topic: str) -> list[tuple[int, str, str]]:
    with connect(db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT kafka_offset, reason, detail FROM kvledger.rejected_events "
            "WHERE kafka_topic = %s ORDER BY kafka_partition, kafka_offset",
            (topic,),
        ).fetchall()
    return [(o, r, d) for o, r, d in rows]


def schema_ids(bootstrap: str, topic: str, group: str, count: int) -> set[int]:
    """The schema ids the topic's ``count`` messages are framed with (Confluent's framing)."""
    ids = set()
    for message in consume_all(bootstrap, topic, group, count):
        value = message.value()
        assert value[:1] == b"\x00", value[:8].hex()
        ids.add(struct.unpack_from(">I", value, 1)[0])
    return ids


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_publish_and_consume_under_each_subject_strategy(
    strategy: str,
    registry_url: str,
    subjects: list[str],
    kafka_bootstrap: str,
    topic: str,
    groups: Callable[[str], str],
    fresh_database: str,
) -> None:
    """The producer path registers the envelope under the strategy's subject and frames
    every message with that id; ``kvledger consume`` resolves it and applies every event;
    the reader registers nothing."""
    subject = subject_for(topic, strategy)
    subjects.append(subject)
    writer = settings.codec(registry_args(registry_url, strategy), topic, writer=True)
    assert writer is not None
    sent = publish(kafka_bootstrap, topic, writer, seed=1)
    latest = call(f"{registry_url}/subjects/{subject}/versions/latest")
    # (The registry drops the inner records' namespaces, the envelope's own: the same schema.)
    assert schema_fingerprint(latest["schema"]) == schema_fingerprint(envelope_schema_json())
    assert schema_ids(kafka_bootstrap, topic, groups("raw"), sent) == {latest["id"]}
    consume(kafka_bootstrap, fresh_database, topic, groups("consume"), registry_url)
    assert audit(fresh_database, topic) == {"applied": sent}
    assert rejected(fresh_database, topic) == []
    assert subject in call(registry_url + "/subjects")
    assert call(f"{registry_url}/subjects/{subject}/versions") == [1]  # the reader added none


def test_the_released_envelopes_evolve_under_one_subject(
    registry_url: str,
    subjects: list[str],
    kafka_bootstrap: str,
    topic: str,
    groups: Callable[[str], str],
    fresh_database: str,
) -> None:
    """0.2.0's envelope, then 0.3.0's (the current one), registered in that order under one
    subject with BACKWARD compatibility: the registry takes the new version, refuses a
    schema an old message could not be read with, and the consumer applies the messages of
    both writers."""
    subject = subject_for(topic)
    subjects.append(subject)
    call(f"{registry_url}/config/{subject}", "PUT", {"compatibility": "BACKWARD"})
    [v020] = [s for s in released_schemas() if "reports_reuse" in s and "requests_running" not in s]
    client = open_registry(registry_url)
    old = Codec(schema_json=v020, registry=client, subject=subject)
    old_sent = publish(kafka_bootstrap, topic, old, seed=1)
    new = settings.codec(registry_args(registry_url), topic, writer=True)
    assert new is not None
    new_sent = publish(kafka_bootstrap, topic, new, seed=2)
    assert call(f"{registry_url}/subjects/{subject}/versions") == [1, 2]
    first, second = (call(f"{registry_url}/subjects/{subject}/versions/{v}")["id"] for v in (1, 2))
    assert first != second
    assert schema_ids(kafka_bootstrap, topic, groups("raw"), old_sent + new_sent) == {
        first,
        second,
    }
    # A field without a default: a reader of it could not read the messages written so far.
    envelope = json.loads(envelope_schema_json())
    envelope["fields"].append({"name": "region", "type": "string"})
    with pytest.raises(SchemaIncompatibleError, match="incompatible"):
        Codec(schema_json=json.dumps(envelope), registry=client, subject=subject)
    assert call(f"{registry_url}/subjects/{subject}/versions") == [1, 2]
    consume(kafka_bootstrap, fresh_database, topic, groups("consume"), registry_url)
    assert audit(fresh_database, topic) == {"applied": old_sent + new_sent}
    assert rejected(fresh_database, topic) == []


def test_a_schema_id_the_registry_does_not_know_is_dead_lettered(
    registry_url: str,
    subjects: list[str],
    kafka_bootstrap: str,
    topic: str,
    groups: Callable[[str], str],
    fresh_database: str,
) -> None:
    """A message framed with an id the registry answers it has not is rejected as
    ``unknown_schema`` with that id, to the dead-letter topic and rejected_events; the
    others are applied and the consumer ends caught up."""
    from confluent_kafka import Producer

    subjects.append(subject_for(topic))
    writer = settings.codec(registry_args(registry_url), topic, writer=True)
    assert writer is not None
    sent = publish(kafka_bootstrap, topic, writer, seed=3)
    unknown = 987_654_321
    body = writer.encode(Envelope("engine-x", "m", 0, 1, 0, 1_700_000_000_000, Heartbeat(0, 5000)))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, value=b"\x00" + struct.pack(">I", unknown) + body[5:], key=b"x/0")
    assert producer.flush(30) == 0
    consume(kafka_bootstrap, fresh_database, topic, groups("consume"), registry_url)
    assert audit(fresh_database, topic) == {"applied": sent, "rejected": 1}
    [(_, reason, detail)] = rejected(fresh_database, topic)
    assert reason == "unknown_schema" and str(unknown) in detail, detail
    [dead] = consume_all(kafka_bootstrap, f"{topic}.dlq", groups("dlq"), 1)
    headers = dict(dead.headers() or [])
    assert headers["kvledger.reason"] == b"unknown_schema"
    assert str(unknown).encode() in headers["kvledger.detail"]


def test_a_wrong_registry_address_is_said_not_dead_lettered(
    registry_url: str, subjects: list[str]
) -> None:
    """The registry's root instead of its Confluent API answers 404 to everything: a writer
    is refused with that said, and a reader raises the registry's failure (the consumer
    waits on it) instead of calling the message unknown."""
    root = registry_url.removesuffix(CONFLUENT_API)
    topic = f"registry-wrong-{uuid.uuid4().hex[:12]}"  # never made: nothing reaches Kafka
    subjects.append(subject_for(topic))
    with pytest.raises(RegistryUnavailableError, match="404"):
        settings.codec(registry_args(root), topic, writer=True)
    writer = settings.codec(registry_args(registry_url), topic, writer=True)
    assert writer is not None
    data = writer.encode(Envelope("engine-x", "m", 0, 1, 0, 1_700_000_000_000, Heartbeat(0, 5000)))
    wrong = settings.codec(registry_args(root), topic, writer=False)
    assert wrong is not None
    with pytest.raises(RegistryUnavailableError, match="ccompat"):
        wrong.decode(data)
    right = settings.codec(registry_args(registry_url), topic, writer=False)
    assert right is not None and right.decode(data).source == "engine-x"
    with pytest.raises(DecodeError, match="unknown_schema"):
        right.decode(data[:1] + struct.pack(">I", 987_654_321) + data[5:])


# ------------------------------------------------------------------ an outage
class PrivateRegistry:
    """A registry of this test's own (scripts/services on free ports, its own state
    folder), to kill and start again without disturbing the shared one."""

    def __init__(self, state: Path) -> None:
        self.port = free_port()
        self.env = dict(
            os.environ,
            KVLEDGER_STATE_DIR=str(state),
            KVLEDGER_REGISTRY_PORT=str(self.port),
            KVLEDGER_REGISTRY_MANAGEMENT_PORT=str(free_port()),
        )
        self.pidfile = state / f"registry-{self.port}" / "registry.pid"

    def start(self) -> str:
        return start_registry(self.env)

    def kill(self) -> None:
        """SIGKILL: no shutdown of its own."""
        pid = int(self.pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def services(self, *words: str) -> str:
        return subprocess.run(
            [SERVICES, *words], env=self.env, capture_output=True, text=True, timeout=120,
            check=False,
        ).stdout  # fmt: skip


def end_offsets(admin: AdminClient, topic: str) -> dict[int, int]:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import OffsetSpec

    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    request = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
    return {tp.partition: f.result().offset for tp, f in admin.list_offsets(request).items()}


def wait_for(what: str, done: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {timeout} s: {what}; its log:\n" + log.read_text()[-3000:]
            )
        time.sleep(0.3)


def test_a_registry_outage_loses_no_event(
    tmp_path: Path,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic: str,
    groups: Callable[[str], str],
    fresh_database: str,
) -> None:
    """The registry killed: a publisher that registered before publishes on (the id is
    all its messages need); a new one is refused, saying the registry did not answer, and
    writes nothing; a consumer that must resolve the id waits, saying for what, and
    dead-letters nothing; so does a router index following the topic (`serve --memory`'s),
    still following. The registry back (its schemas kept): every event published is applied
    exactly once, by both."""
    registry = PrivateRegistry(tmp_path / "state")
    assert settings.ENV_REGISTRY not in exports(registry.env)
    router: RouterIndex | None = None
    try:
        url = registry.start()
        assert "registry" in registry.services("running").split()
        assert f"registry:   running (pid {registry.pidfile.read_text().strip()})" in (
            registry.services("status")
        )
        writer = settings.codec(registry_args(url), topic, writer=True)
        reader = settings.codec(registry_args(url), topic, writer=False)
        assert writer is not None and reader is not None
        before = publish(kafka_bootstrap, topic, writer, seed=1)

        registry.kill()
        assert settings.ENV_REGISTRY not in exports(registry.env)
        during = publish(kafka_bootstrap, topic, writer, seed=2)  # the id is known
        ends = end_offsets(kafka_admin, topic)
        refused = subprocess.run(
            [sys.executable, "-m", "kvledger.cli", "simulate", "--bootstrap", kafka_bootstrap,
             "--topic", topic, "--instances", "1", "--requests", "2", "--schema-registry", url],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stderr[-2000:]
        assert "the schema registry did not answer" in refused.stderr, refused.stderr[-2000:]
        assert url in refused.stderr, refused.stderr[-2000:]
        assert end_offsets(kafka_admin, topic) == ends  # it wrote nothing

        log = tmp_path / "consume.log"
        with log.open("wb") as sink:
            consumer = spawn(
                consume_command(kafka_bootstrap, fresh_database, topic, groups("consume"), url),
                cwd=ROOT, stdout=sink, stderr=sink,
            )  # fmt: skip
        wait_for(
            "the consumer says it waits for the registry (or ends)",
            lambda: (
                "waiting for the schema registry" in log.read_text() or consumer.poll() is not None
            ),
            timeout=90,
            log=log,
        )
        assert consumer.poll() is None, log.read_text()[-3000:]
        assert audit(fresh_database, topic) == {}  # nothing applied, nothing rejected
        assert rejected(fresh_database, topic) == []
        router = RouterIndex(kafka_bootstrap, topic, groups("router"), codec=reader)
        with connect(fresh_database) as conn:
            router.bootstrap(conn)
        router.start()
        wait_for(
            "the router says it waits for the registry",
            lambda: "schema registry" in (router.position().waiting_for or ""),
            timeout=90,
            log=log,
        )
        assert router.position().error is None and router.applied_messages == 0

        registry.start()  # the same folder: the schemas it held
        assert consumer.wait(timeout=180) == 0, log.read_text()[-3000:]
        assert audit(fresh_database, topic) == {"applied": before + during}
        assert rejected(fresh_database, topic) == []
        assert "schema id" in log.read_text()  # what it waited for
        wait_for(
            "the router applied every event",
            lambda: router.applied_messages == before + during,
            timeout=60,
            log=log,
        )
        position = router.position()
        assert position.error is None and position.waiting_for is None
    finally:
        if router is not None:
            router.stop()
        registry.services("down", "registry")
    assert "registry" not in registry.services("running").split()


def test_the_registry_service_says_what_it_needs(tmp_path: Path) -> None:
    """`up registry` without a Java 21+ or on a port already taken fails at once, in one
    line that says what to set, and starts nothing."""
    import socket

    env = dict(os.environ, KVLEDGER_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run(
        [SERVICES, "up", "registry"], env=dict(env, KVLEDGER_REGISTRY_JAVA="/bin/false"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "needs Java 21 or newer: KVLEDGER_REGISTRY_JAVA=/bin/false is no java" in done.stderr
    assert "starting" not in done.stderr and "fetching" not in done.stderr, done.stderr
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        done = subprocess.run(
            [SERVICES, "up", "registry"],
            env=dict(env, KVLEDGER_REGISTRY_PORT=str(taken),
                     KVLEDGER_REGISTRY_MANAGEMENT_PORT=str(free_port())),
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
    assert done.returncode != 0
    assert (
        f"127.0.0.1:{taken} is already in use by another process: choose another port with "
        "KVLEDGER_REGISTRY_PORT" in done.stderr
    ), done.stderr
    assert "starting" not in done.stderr, done.stderr
