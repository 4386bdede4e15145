"""vLLM's own KV-event module (vllm/distributed/kv_events.py from the released wheel), made
importable without torch: the wheel is downloaded once into ~/.cache/kvledger (outside the
checkout) and the module runs beside small stand-ins for the few vLLM helpers it imports
(its config class, logger and network helpers). The event classes and the ZMQ publisher are
vLLM's code, so the bytes on the wire are vLLM's, not our reading of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.33.0"
CACHE = Path(os.environ.get("KVLEDGER_CACHE", Path.home() / ".cache" / "kvledger"))
_MODULE = "vllm/distributed/kv_events.py"

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
    root = CACHE / f"vllm-{VERSION}-kv-events"
    module = root / _MODULE
    if not module.exists():
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
        with zipfile.ZipFile(found[0]) as wheel:
            text = wheel.read(_MODULE).decode("utf-8")
        for rel, source in _STANDINS.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source.lstrip())
        module.write_text(text)
    return root
