"""Fuzz targets: each entry point that takes untrusted bytes, with what must hold for any input.

- ``envelope``: a message from the topic. The codec answers with an Envelope or a
  DecodeError, nothing else; the codec (the compiled core's strict decoder) gives its
  oracle's answer (tests/helpers/avro_strict.py's check, then fastavro).
- ``batch``, ``sglang``, ``trtllm``: an engine's payload (vLLM's and SGLang's msgpack over
  ZMQ, TensorRT-LLM's JSON as the relay wraps it). The engine's reader and the wire form
  (stores split to fit a small message) answer with events in their wire form or a
  VllmEventError, nothing else (a batch the relay cannot carry is recorded lost; one that
  raised anything else would once have stopped the relay).
- ``dynamo``: a Dynamo /query body, read by the compiled core (or declined), its token ids
  hashed in blocks of any size a caller could pass: as many hashes as whole blocks fit, and
  never a panic or a crash (a size times 4 once wrapped).
- ``decisions``: a record on the decisions topic (any replica or client can write one). The
  decoder answers with a decision (or answer) and its record, or a ValueError, nothing else;
  what it accepts encodes back to the same decision.
- ``replay``: a replay request's frames on `kvledger republish`'s ROUTER, against a numbered
  ring: a request is read as [peer, empty, 8-byte start] or refused; the answer for any
  start is the retained batches from it (dense, in order), from the snapshot, nothing yet,
  or "make a snapshot first", and never raises.
- ``group``: the router's index under operations (stores, holders, metadata, the clock,
  expiry) and lookups read from the bytes (crafted hashes included). The compiled core's
  Group and the pure PureGroup hold, expire and answer alike, and neither raises.

Run by ``python -m tests.fuzz`` (atheris, coverage-guided) and over the seed corpus by
tests/unit/test_fuzz_targets.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import atheris

with atheris.instrument_imports():
    from kvledger import _core
    from kvledger.producer.prepared import WireForm
    from kvledger.producer.relay import sglang
    from kvledger.producer.relay.trtllm import TrtllmReader
    from kvledger.producer.relay.wire import EngineBatch, read_batch
    from kvledger.producer.vllm import VllmEventError
    from kvledger.schemas.codec import Codec
    from kvledger.schemas.decisions import decode_record, encode
    from kvledger.schemas.errors import DecodeError
    from kvledger.schemas.events import GroupSpec
    from kvledger.serving.republish.publisher import Outlet, replay_request
    from kvledger.serving.router import groups as store
    from tests.helpers.codecs import OracleCodec
    from tests.helpers.pure_router.group import PureGroup


CODEC, ORACLE = Codec(), OracleCodec()


def _verdict(codec: Codec, data: bytes) -> object:
    try:
        return codec.decode(data)
    except DecodeError as exc:
        return ("rejected", exc.reason)


def envelope(data: bytes) -> None:
    fast = _verdict(CODEC, data)
    assert fast == _verdict(ORACLE, data), (fast, _verdict(ORACLE, data))


SPECS = [
    GroupSpec("m", 0, "full_attention", 16, 16),
    GroupSpec("m", 1, "mamba", 64, 16),
]


def _carried(read: Callable[[bytes], EngineBatch], data: bytes) -> None:
    form = WireForm(False, codec=CODEC, max_bytes=4000)
    for spec in SPECS:
        form.announce(spec)
    with contextlib.suppress(VllmEventError):
        batch = read(data)
        # What the relay stamps on its messages: a time in ms and a rank the envelope carries.
        assert -(2**63) <= round(batch.ts * 1000) < 2**63, batch.ts
        assert batch.dp_rank is None or 0 <= batch.dp_rank < 2**31, batch.dp_rank
        form.prepare(batch.events)


def batch(data: bytes) -> None:
    _carried(read_batch, data)


def sglang_batch(data: bytes) -> None:
    _carried(sglang.read_batch, data)


def trtllm_event(data: bytes) -> None:
    _carried(TrtllmReader(SPECS).read_batch, data)


# Block sizes a caller could pass: the first byte of a dynamo input picks one.
SIZES = (0, 1, 2, 4, 16, -1, 2**61, 2**62, 2**62 + 1, 2**63 - 1)


def dynamo(data: bytes) -> None:
    size = SIZES[data[0] % len(SIZES)] if data else 4
    read = _core.dynamo_token_query(data[1:])
    packed = read[3] if read is not None else b"\x01\x00\x00\x00" * 9
    hashes = _core.dynamo_packed_hashes(packed, size, 0)
    whole = len(packed) // (4 * size) if 0 < size < 2**61 else 0
    assert len(hashes) == whole, (size, len(packed), len(hashes))


KEYS = [bytes([i]) * n for i in range(6) for n in (8, 32)] + [b""]


def group(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    groups = [store.Group(), PureGroup()]

    def key() -> bytes:
        if fdp.ConsumeBool():
            return KEYS[fdp.ConsumeIntInRange(0, len(KEYS) - 1)]
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40))

    def start() -> int:
        """A position: mostly small, else one the compiled row keeps beside it."""
        if fdp.ConsumeBool():
            return fdp.ConsumeIntInRange(-2, 8)
        return fdp.ConsumeIntInRange(-(2**63), 2**62)

    dropped: list[list[int]] = [[] for _ in groups]  # what each expiry dropped, per group
    for _ in range(fdp.ConsumeIntInRange(0, 60)):
        op = fdp.ConsumeIntInRange(0, 6)
        k = key()
        if op == 0:
            parent = key() if fdp.ConsumeBool() else None
            tokens = [fdp.ConsumeIntInRange(0, 3) for _ in range(fdp.ConsumeIntInRange(0, 6))]
            args = (k, parent, start() if fdp.ConsumeBool() else None,
                    tokens, fdp.ConsumeIntInRange(0, 6), fdp.ConsumeBool(),
                    "a" if fdp.ConsumeBool() else None, fdp.ConsumeBool())  # fmt: skip
            for g in groups:
                g.add_row(*args)
        elif op == 1:
            hid, count = fdp.ConsumeIntInRange(0, 200), fdp.ConsumeIntInRange(0, 3)
            for g in groups:
                g.hold(k, hid, count)
        elif op == 2:
            lora, plain = "a" if fdp.ConsumeBool() else None, fdp.ConsumeBool()
            for g in groups:
                g.set_meta(k, lora, plain)
        elif op == 3:
            now = fdp.ConsumeIntInRange(0, 8)
            for g in groups:
                g.set_clock(now)
        elif op == 4:
            cutoff = fdp.ConsumeIntInRange(0, 9)
            for g, out in zip(groups, dropped, strict=True):
                out.append(g.expire(cutoff))
        elif op == 5:  # a whole store event (the router's lane)
            hashes = [k] + [key() for _ in range(fdp.ConsumeIntInRange(0, 3))]
            parent = key() if fdp.ConsumeBool() else None
            size = fdp.ConsumeIntInRange(-1, 4)
            tokens = [fdp.ConsumeIntInRange(0, 3) for _ in range(fdp.ConsumeIntInRange(0, 12))]
            args = (hashes, parent, fdp.ConsumeIntInRange(0, 8) if fdp.ConsumeBool() else None,
                    tokens, size, fdp.ConsumeBool(), "a" if fdp.ConsumeBool() else None,
                    fdp.ConsumeIntInRange(0, 200), fdp.ConsumeBool())  # fmt: skip
            got = [g.store_run(*args) for g in groups]
            assert all(x == got[0] for x in got), "the groups applied a store differently"
        else:  # a whole removal event
            hashes = [k] + [key() for _ in range(fdp.ConsumeIntInRange(0, 3))]
            hid = fdp.ConsumeIntInRange(0, 200)
            got = [g.release_run(hashes, hid) for g in groups]
            assert all(x == got[0] for x in got), "the groups applied a removal differently"
    assert all(out == dropped[0] for out in dropped), "the groups expired differently"
    prompt = [key() for _ in range(fdp.ConsumeIntInRange(0, 20))]
    tokens = [fdp.ConsumeIntInRange(0, 3) for _ in range(fdp.ConsumeIntInRange(0, 24))]
    bs, hbs = fdp.ConsumeIntInRange(0, 6), fdp.ConsumeIntInRange(0, 6)
    ratio, lora = fdp.ConsumeIntInRange(1, 4), "a" if fdp.ConsumeBool() else None

    def answers(g: object) -> tuple[object, ...]:
        return (
            sorted(g.residencies()), sorted(g.hashes()), len(g),  # type: ignore[attr-defined]
            [g.row(k) for k in KEYS], sorted(g.runs(prompt)),  # type: ignore[attr-defined]
            sorted(g.runs_covered(prompt, ratio)),  # type: ignore[attr-defined]
            sorted(g.match_tokens(tokens, bs, hbs, lora)),  # type: ignore[attr-defined]
        )  # fmt: skip

    first, *rest = [answers(g) for g in groups]
    assert all(other == first for other in rest), "the compiled and pure groups disagree"


def decisions(data: bytes) -> None:
    try:
        decision, record = decode_record(data)
    except ValueError:
        return
    again = decode_record(encode(decision, record))
    assert again == (decision, record), (again, decision, record)


def replay(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    outlet = Outlet("e", fdp.ConsumeIntInRange(0, 2**63), True, steps=fdp.ConsumeIntInRange(1, 9),
                    max_bytes=fdp.ConsumeIntInRange(1, 64))  # fmt: skip
    for _ in range(fdp.ConsumeIntInRange(0, 20)):
        outlet.number(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16)), fdp.ConsumeBool())
    if fdp.ConsumeBool():  # well formed, the start near the ring or anywhere
        near = outlet.next_seq + fdp.ConsumeIntInRange(-30, 3)
        at = near if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 2**64 - 1)
        frames = [fdp.ConsumeBytes(4), b"", max(at, 0).to_bytes(8, "big")]
    else:
        count = fdp.ConsumeIntInRange(0, 4)
        frames = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 12)) for _ in range(count)]
    request = replay_request(frames)
    if request is None:
        assert len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8, frames
        return
    peer, start = request
    assert peer == frames[0] and 0 <= start < 2**64
    answer = outlet.replay(start)
    first = outlet.ring[0][0] if outlet.ring else outlet.next_seq
    if answer is None:
        assert start < first and outlet.snapshot_seq is None
        return
    seqs = [s for s, _ in answer]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True, seqs
    if start >= outlet.next_seq:
        assert answer == []
    elif start >= first:
        assert seqs[0] == start and seqs[-1] == outlet.next_seq - 1
    else:
        assert seqs[0] == outlet.snapshot_seq


TARGETS: dict[str, Callable[[bytes], None]] = {
    "envelope": envelope, "batch": batch, "sglang": sglang_batch, "trtllm": trtllm_event,
    "dynamo": dynamo, "group": group, "decisions": decisions, "replay": replay,
}  # fmt: skip
