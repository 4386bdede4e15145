"""vLLM's own offloading events tracker
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py) from the released 0.33.0
and 0.34.0 wheels, importable without torch.

The tracker module is taken from the wheel unchanged, and so is vLLM's event module. What it
imports from modules that pull in torch and the engine's configuration at their top
(``vllm/v1/kv_offload/base.py``, ``vllm/v1/core/kv_cache_utils.py``) is taken from the same
wheel definition by definition (by name, with Python's ``ast``), so the offload keys, request
contexts, raw events and the block-hash view the tracker runs on are vLLM's code too. Small
stand-ins cover the rest: a logger with ``warning_once``, the environment switch for integer
hashes (off, so hashes stay bytes), a ``MambaSpec`` class the tracker tests a group's spec
against, and the ``Request`` name its annotations use.
"""

from __future__ import annotations

import ast
import contextlib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from tests.helpers.vllm_wheel import _STANDINS, CACHE, wheel_file, wheel_module

VERSIONS = ("0.33.0", "0.34.0")
TRACKER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events"
_WHOLE = (
    "vllm/distributed/kv_events.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py",
)

# Modules the tracker imports names from, and the names taken from the wheel's own source
# (those a release lacks are left out: the tracker's import says if it needed one).
_TAKEN: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm/v1/kv_offload/base.py": (
        "from dataclasses import dataclass, field\n"
        "from enum import Enum, auto\n"
        "from typing import Any, ClassVar, NamedTuple, NewType, TypeVar\n"
        "KvHintsEnvelope = Any\n",
        (
            "OffloadKey", "make_offload_key", "get_offload_block_hash", "get_offload_group_idx",
            "_T", "Medium", "Locality", "TierMatcher", "TierFilter", "TierFilter.ALL",
            "ReqContext", "OffloadingEvent", "OffloadingKVEventsConfig",
        ),
    ),
    "vllm/v1/core/kv_cache_utils.py": (
        "from collections.abc import Iterable, Iterator, Sequence\n"
        "from typing import Any, NamedTuple, NewType, TypeAlias, TypeVar, cast, overload\n"
        "from vllm import envs\n",
        (
            "BlockHash", "ExternalBlockHash", "maybe_convert_block_hash",
            "BlockHashListWithBlockSize", "BlockHashList", "resolve_block_hashes",
            "to_event_extra_keys",
        ),
    ),
}  # fmt: skip

_STUBS = {
    **{k: v for k, v in _STANDINS.items() if k != "vllm/v1/core/kv_cache_utils.py"},
    "vllm/envs.py": "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False\n",
    "vllm/logger.py": '''
import logging


class _Logger(logging.LoggerAdapter):
    """Stand-in: vLLM's logger, with its once-only warning."""

    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})
        self.said = set()

    def warning_once(self, msg, *args):
        if msg not in self.said:
            self.said.add(msg)
            self.warning(msg, *args)

    def info_once(self, msg, *args):
        self.info(msg, *args)


def init_logger(name):
    return _Logger(name)
''',
    "vllm/v1/kv_cache_interface.py": '''
class KVCacheSpec:
    """Stand-in: the tracker only asks whether a group's spec is a MambaSpec."""


class MambaSpec(KVCacheSpec):
    pass


class KVCacheGroupSpec:
    pass


def get_kv_cache_spec_kind(kv_cache_spec):
    raise NotImplementedError("not used by the tracker's tests")


def get_kv_cache_spec_sliding_window(kv_cache_spec):
    raise NotImplementedError("not used by the tracker's tests")
''',
    "vllm/v1/request.py": 'class Request:\n    """Stand-in: a name in annotations."""\n',
    "vllm/distributed/kv_transfer/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/__init__.py": "",
    "vllm/v1/kv_offload/__init__.py": "",
}


def taken(source: str, names: tuple[str, ...]) -> str:
    """The top-level statements of ``source`` that define ``names`` (a class, a function, an
    assignment to a name or to ``Class.attr``), in the source's order, decorators included."""
    tree = ast.parse(source)
    out = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = ast.unparse(node.targets[0])
        elif isinstance(node, ast.AnnAssign):
            name = ast.unparse(node.target)
        else:
            continue
        if name in names:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            lines = source.splitlines()[start - 1 : node.end_lineno]
            out.append("\n".join(lines))
    return "\n\n\n".join(out) + "\n"


def tracker_root(version: str) -> Path:
    """A folder whose ``vllm`` package runs vLLM ``version``'s offloading events tracker;
    the wheel is downloaded once into the cache (see tests/helpers/vllm_wheel.py)."""
    root = CACHE / f"vllm-{version}-tracker"
    if (root / _WHOLE[1]).exists():
        return root
    wheel = wheel_file("vllm", version)
    staging = root.with_name(root.name + ".partial")
    with zipfile.ZipFile(wheel) as whole:
        for rel, text in _STUBS.items():
            _write(staging / rel, text.lstrip())
        for rel, (prelude, names) in _TAKEN.items():
            source = whole.read(rel).decode("utf-8")
            _write(staging / rel, f'"""Taken from vLLM {version}\'s {rel}."""\n{prelude}\n'
                   + taken(source, names))  # fmt: skip
        for rel in _WHOLE:
            _write(staging / rel, whole.read(rel).decode("utf-8"))
    staging.rename(root)
    return root


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@contextlib.contextmanager
def vllm_tracker(version: str) -> Iterator[tuple[ModuleType, ModuleType]]:
    """vLLM ``version``'s tracker module and its base module (keys, contexts, raw events),
    the import system restored after; skipped when the wheel cannot be had, unless CI."""
    with wheel_module("vllm", lambda: tracker_root(version), TRACKER) as events:
        import importlib

        yield events, importlib.import_module("vllm.v1.kv_offload.base")
