"""The publisher's handoff (producer/handoff.py) and an embedded engine's use of it: batches
written in order on another thread, a full queue that blocks, a failure raised from the next
call (once), nothing left unwritten at a drain or a stop."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from kvledger.producer.config import PublisherConfig
from kvledger.producer.errors import PublishError
from kvledger.producer.handoff import Handoff
from kvledger.producer.publisher import KVEventPublisher
from kvledger.producer.vllm import VllmEventError


def test_batches_are_written_in_order_on_the_writer_thread() -> None:
    written: list[tuple[int, str]] = []
    handoff = Handoff(lambda item: written.append((item, threading.current_thread().name)), 4, "w")
    for i in range(100):
        handoff.put(i)
    handoff.drain(10)
    assert [i for i, _ in written] == list(range(100))
    assert {name for _, name in written} == {"w"}
    handoff.stop(10)


def test_a_full_queue_blocks_the_caller_until_the_writer_catches_up() -> None:
    release, started = threading.Event(), threading.Event()

    def slow(item: int) -> None:
        started.set()
        release.wait(10)

    handoff = Handoff(slow, 2, "w")
    handoff.put(0)  # taken by the writer, which waits
    assert started.wait(10)
    handoff.put(1)  # waiting: the queue is full
    third = threading.Thread(target=handoff.put, args=(2,))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a third batch went in past a full queue"
    release.set()
    third.join(10)
    assert not third.is_alive()
    handoff.stop(10)


def test_callers_on_many_threads_never_have_more_than_the_capacity_waiting() -> None:
    """Four threads put 2,000 items each into a handoff of two: every item is written once,
    each thread's in its order, and no put returned while two items it could see were
    still unwritten beyond the capacity."""
    capacity, lock = 2, threading.Lock()
    returned, written, worst = [0], [0], [0]
    seen: list[tuple[int, int]] = []

    def write(item: tuple[int, int]) -> None:
        with lock:
            written[0] += 1
        seen.append(item)

    handoff = Handoff(write, capacity, "w")

    def caller(t: int) -> None:
        for i in range(2000):
            handoff.put((t, i))
            with lock:
                returned[0] += 1
                worst[0] = max(worst[0], returned[0] - written[0])

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    handoff.stop(10)
    assert sorted(seen) == [(t, i) for t in range(4) for i in range(2000)]
    for t in range(4):
        assert [i for u, i in seen if u == t] == list(range(2000))
    # A put returns once its item is queued: with four callers, at most the capacity
    # plus one item each can be queued or being written when one returns.
    assert worst[0] <= capacity + 4


def test_a_failure_raises_from_the_next_call_once_and_the_rest_is_written() -> None:
    written: list[int] = []

    def write(item: int) -> None:
        if item == 1:
            raise ValueError("batch 1 is unreadable")
        written.append(item)

    handoff = Handoff(write, 8, "w")
    for i in range(3):
        handoff.put(i)
    with pytest.raises(ValueError, match="batch 1"):
        handoff.drain(10)
    handoff.drain(10)  # raised once
    handoff.put(3)
    handoff.stop(10)  # what was put is written before the thread ends
    assert written == [0, 2, 3]
    with pytest.raises(RuntimeError, match="stopped"):
        handoff.put(4)


class BlockStored(SimpleNamespace):  # vLLM's class name and fields
    pass


def _vllm_batch(hashes: list[object]) -> SimpleNamespace:
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[1, 2],
                         block_size=2, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
    return SimpleNamespace(ts=1.0, data_parallel_rank=None, events=[stored])


def test_an_unreadable_vllm_batch_raises_from_the_engines_next_call() -> None:
    """No broker: the messages wait in the client's queue, which is all this needs."""
    config = PublisherConfig("127.0.0.1:1", "engine-h", "m", startup_timeout_s=0,
                             heartbeat_interval_s=0, create_partitions=0)  # fmt: skip
    pub = KVEventPublisher(config)
    try:
        assert pub.publish_vllm_batch(_vllm_batch([1])) == 1  # a queue put, then back
        pub.publish_vllm_batch(_vllm_batch([-1]))  # not an unsigned 64-bit hash
        with pytest.raises(VllmEventError, match="unsigned"):
            pub.publish_events([])  # waits for the batches before it, then raises
        assert pub.next_seqs() == {0: 1}  # the bad batch took no number
    finally:
        with contextlib.suppress(PublishError):  # nothing can be acknowledged here
            pub.close(timeout=0.5, goodbye=False)


def test_a_bounded_put_gives_up_and_leaves_the_count_whole() -> None:
    """``put(item, wait_s)`` on a full queue returns False after about ``wait_s`` with the
    item not taken; the writer goes on, and later puts (bounded or not) are written in
    order, none lost and none doubled."""
    import time

    gate = threading.Event()
    written: list[int] = []

    def write(item: int) -> None:
        gate.wait(10)
        written.append(item)

    handoff = Handoff(write, 2, "w")
    assert handoff.put(0, wait_s=0.05) and handoff.put(1, wait_s=0.05)
    started = time.monotonic()
    assert handoff.put(2, wait_s=0.1) is False  # full: refused, not taken
    assert 0.08 <= time.monotonic() - started < 2
    gate.set()
    for i in range(3, 40):
        assert handoff.put(i, wait_s=5) if i % 2 else handoff.put(i) in (None, True)
    handoff.drain(10)
    assert written == [0, 1, *range(3, 40)]
    handoff.stop(10)
