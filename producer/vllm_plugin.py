"""kvledger inside a vLLM engine: a general plugin that publishes the engine's KV event
batches straight to Kafka with kvledger's producer library, no relay beside it.

``pip install 'kvledger[vllm]'`` into the engine's environment puts :func:`register` in
vLLM's ``vllm.general_plugins`` entry-point group; vLLM's plugin loader calls it in every
process it starts, before the scheduler builds its event publisher. vLLM's configuration
cannot name a third publisher (``KVEventsConfig.publisher`` is ``"null"`` or ``"zmq"``,
extra fields forbidden), so the plugin does what the configuration allows: where
``KVLEDGER_VLLM_SOURCE`` is set, the ``"zmq"`` publisher the engine asks for
(``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
becomes one that publishes each batch on vLLM's ZMQ socket as before (its subscribers keep
working) and hands it to a :class:`~kvledger.producer.publisher.KVEventPublisher`: a new
epoch per engine process, sequence numbers, heartbeats, a goodbye on shutdown, the writer
on a thread of its own (the scheduler's thread pays a queue put).

Settings, from the engine's environment (read and checked at start-up: a bad one stops the
engine with the reason):

- ``KVLEDGER_VLLM_SOURCE``: the engine's source id (``{rank}`` is replaced by the
  data-parallel rank; without it, ranks past 0 are ``<source>-dp<rank>``). Unset: the
  plugin does nothing.
- ``KVLEDGER_KAFKA_BOOTSTRAP`` (required), ``KVLEDGER_TOPIC`` (``kv-events``),
  ``KVLEDGER_KAFKA_CONFIG`` (a properties file of client settings, as every command's).
- ``KVLEDGER_VLLM_MODEL``: the model's name in the index (else the engine's served name,
  read from the scheduler that asks for the publisher).
- ``KVLEDGER_VLLM_GROUPS``: the groups' specs, ``IDX:KIND:BLOCK_SIZE[:HASH_BLOCK_SIZE]``
  comma-separated, as the relay's ``--group`` (else one full-attention group of the
  engine's block size; a hybrid model's groups must be given).
- ``KVLEDGER_VLLM_MAX_WAIT_MS`` (1): the longest the scheduler's thread waits for room in
  the writer's queue (``KVLEDGER_VLLM_QUEUE`` batches, 1024). Past it the batch is not
  published, the engine's log says so, and once there is room again the index is told the
  batches lost (``EventsLost``: it ends what the source held, then follows it afresh). So a
  Kafka outage never stalls the engine: Kafka's client holds what it cannot send for two
  minutes (then counts it failed, and the next batch's log says so), and the queue what
  the client cannot take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

from kvledger.producer.config import PublisherConfig
from kvledger.producer.errors import PublishError, QueueFullError
from kvledger.schemas.events import GroupSpec

# Under vLLM's own logger: the engine's log shows these lines in its format, with its own.
logger = logging.getLogger("vllm.plugins.kvledger")

ENV_SOURCE = "KVLEDGER_VLLM_SOURCE"
LOG_EVERY_S = 10.0  # a failing publisher says so at most this often


class PluginConfigError(ValueError):
    """A kvledger setting in the engine's environment is wrong (the engine does not start)."""


@dataclass(frozen=True)
class PluginSettings:
    source: str
    bootstrap: str
    topic: str
    kafka: dict[str, str]
    model: str | None
    groups: tuple[str, ...]
    max_wait_s: float
    queue: int

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] = os.environ) -> PluginSettings:
        from kvledger.settings import read_properties

        source = env.get(ENV_SOURCE, "").strip()
        bootstrap = env.get("KVLEDGER_KAFKA_BOOTSTRAP", "").strip()
        if not source:
            raise PluginConfigError(f"{ENV_SOURCE} is empty")
        if not bootstrap:
            raise PluginConfigError(f"{ENV_SOURCE} is set, KVLEDGER_KAFKA_BOOTSTRAP is not")
        kafka: dict[str, str] = {}
        if path := env.get("KVLEDGER_KAFKA_CONFIG"):
            try:
                kafka = read_properties(path)
            except SystemExit as exc:  # the reason, as the commands say it
                raise PluginConfigError(str(exc)) from None
        groups = tuple(g.strip() for g in env.get("KVLEDGER_VLLM_GROUPS", "").split(",") if g)
        return cls(
            source,
            bootstrap,
            env.get("KVLEDGER_TOPIC") or "kv-events",
            kafka,
            env.get("KVLEDGER_VLLM_MODEL") or None,
            groups,
            _number(env, "KVLEDGER_VLLM_MAX_WAIT_MS", 1.0, 0.0) / 1000,
            int(_number(env, "KVLEDGER_VLLM_QUEUE", 1024, 1)),
        )

    def source_for(self, rank: int) -> str:
        if "{rank}" in self.source:
            return self.source.replace("{rank}", str(rank))
        return self.source if rank == 0 else f"{self.source}-dp{rank}"


def _number(env: Any, name: str, default: float, low: float) -> float:
    text = env.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise PluginConfigError(f"{name} must be a number, not {text!r}") from None
    if not value >= low or value == float("inf"):
        raise PluginConfigError(f"{name} must be at least {low:g}, not {text}")
    return value


def register() -> None:
    """vLLM's plugin entry point: where kvledger is configured, the ``"zmq"`` publisher
    becomes :class:`KvledgerPublisher` (see the module doc). Idempotent per process."""
    if ENV_SOURCE not in os.environ:
        return
    settings = PluginSettings.from_env()  # a bad setting stops the engine here
    from vllm.distributed import kv_events

    registry = kv_events.EventPublisherFactory._registry
    zmq_publisher = registry["zmq"]
    if getattr(zmq_publisher, "kvledger", False):
        return

    def make(data_parallel_rank: int = 0, **config: Any) -> Any:
        return KvledgerPublisher(
            zmq_publisher(data_parallel_rank=data_parallel_rank, **config),
            settings,
            data_parallel_rank,
        )

    make.kvledger = True  # type: ignore[attr-defined]
    registry["zmq"] = make
    logger.info(
        "kvledger: KV events of this engine go to Kafka %s, topic %s, as source %s",
        settings.bootstrap,
        settings.topic,
        settings.source,
    )


def _engine_defaults() -> tuple[str | None, int | None]:
    """The served model's name and the block size, from the engine's configuration: the
    scheduler that is asking for its publisher holds it (vLLM's factory passes only the
    events config on: the caller's frames are read, a few at most), else the configuration
    vLLM has made current."""
    config = None
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        candidate = getattr(frame.f_locals.get("self"), "vllm_config", None)
        if getattr(candidate, "cache_config", None) is not None:
            config = candidate
            break
        frame = frame.f_back
    try:
        if config is None:
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
        names = config.model_config.served_model_name
        name = names[0] if isinstance(names, list | tuple) else names
        return (str(name) if name else None), int(config.cache_config.block_size)
    except Exception:  # an engine without them: the settings must say
        return None, None


def _groups(settings: PluginSettings, model: str, block_size: int | None) -> list[GroupSpec]:
    from kvledger.producer.relay.config import parse_group

    texts = settings.groups
    if not texts:
        if block_size is None:
            raise PluginConfigError(
                "KVLEDGER_VLLM_GROUPS is not set and the engine's block size is unknown"
            )
        texts = (f"0:full_attention:{block_size}",)
    try:
        return [parse_group(t, model) for t in texts]
    except ValueError as exc:
        raise PluginConfigError(f"KVLEDGER_VLLM_GROUPS: {exc}") from None


class KvledgerPublisher:
    """vLLM's ZMQ publisher, and each batch handed to kvledger's producer as well."""

    def __init__(self, zmq_publisher: Any, settings: PluginSettings, rank: int) -> None:
        self._zmq = zmq_publisher
        self.settings = settings
        engine_model, block_size = _engine_defaults()
        model = settings.model or engine_model
        if not model:
            raise PluginConfigError("KVLEDGER_VLLM_MODEL is not set and the engine has no name")
        groups = _groups(settings, model, block_size)
        config = PublisherConfig(
            bootstrap_servers=settings.bootstrap,
            source_id=settings.source_for(rank),
            model=model,
            topic=settings.topic,
            dp_rank=rank,
            kafka=settings.kafka,
            handoff_batches=settings.queue,
        )
        self._config, self._groups = config, groups
        self._kv = self._open()
        self._reopened_at = time.monotonic()
        self._seq = 0  # the engine's batches, numbered as its ZMQ stream numbers them
        self._lost: tuple[int, int] | None = None  # batches not published, not yet said
        self.lost_batches = 0
        self._said_at = float("-inf")
        logger.info(
            "kvledger: publishing source %s (model %s, groups %s)",
            config.source_id,
            model,
            ", ".join(f"{g.group_idx}:{g.kind}:{g.block_size}" for g in groups),
        )

    def _open(self, check: bool = True) -> Any:
        """A publisher with the groups announced; ``check``: ask the broker first (at the
        engine's start-up only: never on the scheduler's thread while the engine serves)."""
        from kvledger.producer.publisher import KVEventPublisher

        config = self._config if check else dataclasses.replace(self._config, startup_timeout_s=0)
        publisher = KVEventPublisher(config)
        for spec in self._groups:
            publisher.announce_group_spec(spec)
        return publisher

    def publish(self, events: Any) -> None:
        self._zmq.publish(events)
        seq = self._seq
        self._seq += 1
        kv, wait = self._kv, self.settings.max_wait_s
        try:
            if self._lost is not None:
                if not kv.record_lost(*self._lost, wait_s=wait):
                    raise QueueFullError("the writer's queue is full")
                self._lost = None
            kv.publish_vllm_batch(events, engine_seq=seq, wait_s=wait)
        except QueueFullError as exc:  # the engine goes on; what was not published is said
            self._lose(seq, str(exc))
        except PublishError as exc:  # messages failed for good: a new publisher, a new epoch
            self._lose(seq, str(exc))
            self._reopen()

    def _lose(self, seq: int, why: str) -> None:
        first = self._lost[0] if self._lost is not None else seq
        self._lost = (first, seq)
        self.lost_batches += 1
        self._say(f"batch {seq} not published to Kafka ({why}); {self.lost_batches} so far")

    def _reopen(self) -> None:
        """Past a delivery failure a publisher takes nothing more: after ``LOG_EVERY_S``,
        a new one (a new epoch: the index ends what the old one said the engine held, and
        follows the new one from its first store)."""
        now = time.monotonic()
        if now - self._reopened_at < LOG_EVERY_S:
            return
        self._reopened_at = now
        old = self._kv
        try:
            self._kv = self._open(check=False)
        except Exception as exc:  # the old one stays (and fails), and says so
            self._say(f"cannot open a new publisher: {exc}")
            return
        self._lost = None  # a new epoch starts from nothing: nothing to say of the old
        with contextlib.suppress(Exception):  # it failed already; its reason was said
            old.close(timeout=0, goodbye=False)

    def _say(self, text: str) -> None:
        now = time.monotonic()
        if now - self._said_at >= LOG_EVERY_S:
            self._said_at = now
            logger.warning("kvledger: %s", text)

    def shutdown(self) -> None:
        try:
            self._zmq.shutdown()
        finally:
            try:
                self._kv.close(timeout=10)
            except Exception as exc:  # shutting down: say it, do not hide the engine's exit
                logger.warning("kvledger: closing the publisher: %s", exc)

    def get_publisher_config(self) -> Any:
        getter = getattr(self._zmq, "get_publisher_config", None)
        return getter() if getter is not None else None
