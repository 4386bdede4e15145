"""Small helpers for tests that read a topic back."""

from __future__ import annotations

from confluent_kafka import Consumer, Message


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
