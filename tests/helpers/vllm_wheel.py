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
from collections.abc import Iterator
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


def vllm_root() -> Path:
    """A folder whose ``vllm`` package holds vLLM's kv_events module and the stand-ins;
    downloads the wheel on first use (raises when the registry cannot be reached)."""
    root = CACHE / f"vllm-{VERSION}-modules"
    if not all((root / m).exists() for m in _MODULES):
        wheels = CACHE / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        found = sorted(wheels.glob(f"vllm-{VERSION}-*.whl"))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                 "--dest", str(wheels), f"vllm=={VERSION}"],
                check=True, timeout=900,
            )  # fmt: skip
            found = sorted(wheels.glob(f"vllm-{VERSION}-*.whl"))
        for rel, source in _STANDINS.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source.lstrip())
        with zipfile.ZipFile(found[0]) as wheel:
            for rel in _MODULES:
                (root / rel).write_text(wheel.read(rel).decode("utf-8"))
    return root


@contextlib.contextmanager
def vllm_module(name: str) -> Iterator[ModuleType]:
    """One of vLLM's modules, imported from the wheel (the import system restored after);
    skipped when the wheel cannot be had, unless CI is set."""
    import pytest

    try:
        root = vllm_root()
    except (subprocess.SubprocessError, OSError, KeyError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the vLLM wheel could not be had: {exc!r}")
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        for loaded in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[loaded]
