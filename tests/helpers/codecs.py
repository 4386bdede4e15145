"""Codecs for tests that hold the compiled decoder and the pure path to one answer."""

from __future__ import annotations

import os

from kvledger.schemas.codec import Codec


def pure_codec() -> Codec:
    """A codec on the pure path (avro_strict, then fastavro): KVLEDGER_PURE_AVRO=1 while it
    is made, the variable as it was afterwards."""
    saved = os.environ.get("KVLEDGER_PURE_AVRO")
    os.environ["KVLEDGER_PURE_AVRO"] = "1"
    try:
        return Codec()
    finally:
        if saved is None:
            del os.environ["KVLEDGER_PURE_AVRO"]
        else:
            os.environ["KVLEDGER_PURE_AVRO"] = saved
