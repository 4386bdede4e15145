"""SGLang's own KV-event module (sglang/srt/disaggregation/kv_events.py from the released
0.5.23 wheel), made importable without torch: the wheel is downloaded once into
~/.cache/kvledger and the module runs unchanged beside stand-ins for the two SGLang helpers
it imports (``runtime_context.get_parallel``: a single rank; ``utils.network.
NetworkAddress``: host and port parsing). Its event classes and its ZMQ publisher are
SGLang's code, so the bytes on the wire are SGLang's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from tests.helpers.vllm_wheel import wheel_module, wheel_root

VERSION = "0.5.23"
_MODULES = ("sglang/srt/disaggregation/kv_events.py",)
_STANDINS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/runtime_context.py": '''
from types import SimpleNamespace


def get_parallel():
    """Stand-in: one scheduler, rank 0 of every parallel dimension."""
    return SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0)
''',
    "sglang/srt/utils/network.py": '''
from dataclasses import dataclass


@dataclass(frozen=True)
class NetworkAddress:
    """Stand-in: a host and a port, IPv6 in brackets."""

    host: str
    port: int

    @property
    def is_ipv6(self):
        return ":" in self.host

    @classmethod
    def parse(cls, text):
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = text.rpartition(":")
        try:
            return cls(host, int(port))
        except ValueError:
            raise ValueError(f"not host:port: {text!r}") from None

    def to_tcp(self):
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{host}:{self.port}"
''',
}


def sglang_root() -> Path:
    return wheel_root("sglang", VERSION, _MODULES, _STANDINS)


@contextlib.contextmanager
def sglang_kv_events() -> Iterator[ModuleType]:
    """SGLang's kv_events module from its wheel (skipped without it, unless CI is set)."""
    with wheel_module("sglang", sglang_root, "sglang.srt.disaggregation.kv_events") as module:
        yield module
