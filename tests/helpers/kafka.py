"""Small helpers for tests that read a topic back, or need a broker of their own."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from confluent_kafka import Consumer, Message

from tests.helpers.procs import free_port

_SERVICES = str(Path(__file__).resolve().parents[2] / "scripts" / "services")


def consume_all(
    bootstrap: str, topic: str, group_id: str, expected: int, timeout: float = 60.0
) -> list[Message]:
    """Read ``expected`` messages from the start of ``topic`` (fails the test on a stall)."""
    import time

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group_id,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expected:
            if time.monotonic() > deadline:
                raise AssertionError(f"read {len(out)} of {expected} messages in {timeout} s")
            for msg in consumer.consume(10000, timeout=1.0):
                if msg.error() is not None:
                    raise AssertionError(str(msg.error()))
                out.append(msg)
        # Nothing more than expected may arrive.
        extra = consumer.consume(1000, timeout=1.0)
        out.extend(m for m in extra if m.error() is None)
    finally:
        consumer.close()
    return out


class PrivateKafka:
    """A broker of one test's own (scripts/services on free ports with its own state
    folder), to stop and start at will without disturbing the shared one."""

    def __init__(self, state_dir: Path, security: str = "plaintext") -> None:
        self.env = dict(
            os.environ,
            KVLEDGER_KAFKA_PORT=str(free_port()),
            KVLEDGER_KAFKA_CONTROLLER_PORT=str(free_port()),
            KVLEDGER_STATE_DIR=str(state_dir),
            KVLEDGER_KAFKA_SECURITY=security,
        )
        self.bootstrap = f"127.0.0.1:{self.env['KVLEDGER_KAFKA_PORT']}"
        self.admin_config: str | None = None  # with security: the admin's client properties

    def start(self) -> None:
        subprocess.run([_SERVICES, "up", "kafka"], env=self.env, check=True)
        printed = subprocess.run(
            [_SERVICES, "env"], env=self.env, check=True, capture_output=True, text=True
        ).stdout
        for line in printed.splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            if name == "KVLEDGER_KAFKA_CONFIG":
                self.admin_config = value

    def stop(self, check: bool = True) -> None:
        subprocess.run([_SERVICES, "down", "kafka"], env=self.env, check=check)


@contextmanager
def private_kafka(state_dir: Path, security: str = "plaintext") -> Iterator[PrivateKafka]:
    """A started :class:`PrivateKafka`, stopped when the block ends however it ends."""
    broker = PrivateKafka(state_dir, security)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop(check=False)
