"""vLLM's own KV-event module (vllm/distributed/kv_events.py from the released wheel), made
importable without torch: the wheel is downloaded once into ~/.cache/kvledger (outside the
checkout) and the module runs beside small stand-ins for the few vLLM helpers it imports
(its config class, logger and network helpers). The event classes and the ZMQ publisher are
vLLM's code, so the bytes on the wire are vLLM's, not our reading of them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

VERSION = "0.33.0"
CACHE = Path(os.environ.get("KVLEDGER_CACHE", Path.home() / ".cache" / "kvledger"))
# vLLM's own modules the tests run: its KV-event publisher and its hash functions.
_MODULES = ("vllm/distributed/kv_events.py", "vllm/utils/hashing.py")

_STANDINS = {
    "vllm/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/config/kv_events.py": '''
class KVEventsConfig:
    """Stand-in: the fields vLLM's publisher passes, kept as attributes."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
''',
    "vllm/logger.py": """
import logging


def init_logger(name):
    return logging.getLogger(name)
""",
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": """
import ipaddress


def get_ip():
    return "127.0.0.1"


def get_tcp_uri(ip, port):
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def is_valid_ipv6_address(address):
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def split_zmq_path(path):
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host, port
""",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/kv_cache_utils.py": "ExternalBlockHash = bytes | int\n",
    "vllm/distributed/__init__.py": "",
}


def vllm_root(version: str = VERSION) -> Path:
    """A folder whose ``vllm`` package holds vLLM ``version``'s kv_events module and the
    stand-ins; downloads the wheel on first use (raises when the registry cannot be reached)."""
    return wheel_root("vllm", version, _MODULES, _STANDINS)


@contextlib.contextmanager
def vllm_module(name: str, version: str = VERSION) -> Iterator[ModuleType]:
    """One of vLLM ``version``'s modules, imported from the wheel (the import system
    restored after); skipped when the wheel cannot be had, unless CI is set."""
    with wheel_module("vllm", lambda: vllm_root(version), name) as module:
        yield module


def wheel_root(
    package: str, version: str, modules: tuple[str, ...], standins: dict[str, str]
) -> Path:
    """A folder holding ``modules`` (paths inside the wheel) taken unchanged from the
    released wheel of ``package`` ``version``, beside ``standins`` (path -> source) for what
    they import that the tests do not run; the wheel is downloaded once into the cache."""
    root = CACHE / f"{package}-{version}-modules"
    if not all((root / m).exists() for m in modules):
        found = wheel_file(package, version)
        for rel, source in standins.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source.lstrip())
        with zipfile.ZipFile(found) as wheel:
            for rel in modules:
                (root / rel).write_text(wheel.read(rel).decode("utf-8"))
    return root


def wheel_file(package: str, version: str) -> Path:
    """The released wheel of ``package`` ``version``, downloaded once into the cache."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{package}-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--dest", str(wheels), f"{package}=={version}"],
            check=True, timeout=900,
        )  # fmt: skip
        found = sorted(wheels.glob(f"{package}-{version}-*.whl"))
    return found[0]


@contextlib.contextmanager
def wheel_module(package: str, root_of: Callable[[], Path], name: str) -> Iterator[ModuleType]:
    """Module ``name`` of ``package`` imported from ``root_of()`` (see :func:`wheel_root`),
    the import system restored after; skipped when the wheel cannot be had, unless CI is
    set."""
    import pytest

    try:
        root = root_of()
    except (subprocess.SubprocessError, OSError, KeyError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the {package} wheel could not be had: {exc!r}")
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        for loaded in [n for n in sys.modules if n == package or n.startswith(f"{package}.")]:
            del sys.modules[loaded]
