"""`kvledger serve`'s HTTP protocol (serving/lookup/hot_protocol.py): uvicorn's httptools
protocol answering the hot routes (POST /v1/match from memory, Dynamo's /query and
/query_by_hash) in its parser's callbacks. Two real uvicorn servers on loopback sockets,
one with it and one with uvicorn's own protocol, over one app: every request must get the
same status, headers and bytes from both, in order on a kept-alive connection, pipelined
or not, and be counted alike. A router index filled through the pipeline, no services."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvledger.consumer.pipeline import run_batch
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts
from kvledger.schemas.codec import Codec
from kvledger.serving.lookup.door import Door
from kvledger.serving.lookup.guarded_protocol import HttpLimits
from kvledger.serving.lookup.hot_protocol import protocol
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.serving.lookup.metrics import REQUESTS
from kvledger.serving.router.index import RouterIndex
from tests.helpers.streams import fleet_stream
from tests.helpers.uvicorn_server import serving

FLEET = FleetConfig(instances=3, requests=40, seed=9)
BEARER = b"authorization: Bearer s3cret\r\n"
WIDE = 9e8  # a silence window that keeps the 2025 stream's sources live


@pytest.fixture(scope="module")
def app() -> Door:
    return make_app()


def make_app(extra: tuple[Any, ...] = ()) -> Door:
    """The service from memory with Dynamo's API, its index filled through the pipeline."""
    router = RouterIndex("127.0.0.1:9", "t", "g", dynamo=True)  # never started: filled here
    messages = fleet_stream(FLEET).messages
    for i in range(0, len(messages), 200):
        run_batch(messages[i : i + 200], Codec(), router.store, "g")
    from datetime import timedelta

    config = ServiceConfig(
        router=router, token="s3cret", dynamo_api=True, silent_after=timedelta(seconds=WIDE)
    )
    made = create_app(config, extra)
    assert isinstance(made, Door)
    return made


@contextmanager
def server(
    app: Any, hot: bool, limits: HttpLimits | None = None, http: Any = None
) -> Iterator[int]:
    """A uvicorn server on a free loopback port: with the hot protocol (within ``limits``),
    uvicorn's own, or ``http`` when given."""
    if http is None:
        http = protocol(app, limits) if hot else "httptools"
    with serving(app, http) as port:
        yield port


def post(path: str, body: bytes, *extra: bytes, length: bool = True) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1\r\n", b"host: t\r\n",
            b"content-type: application/json\r\n", *extra]  # fmt: skip
    if length:
        head.append(b"content-length: %d\r\n" % len(body))
        return b"".join([*head, b"\r\n", body])
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return b"".join([*head, b"transfer-encoding: chunked\r\n\r\n", chunked])


def read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` responses from ``sock``, in order: (status, headers but the date, body)."""
    f = sock.makefile("rb")
    out = []
    for _ in range(count):
        status = int(f.readline().split()[1])
        if status == 100:  # an interim answer to Expect: 100-continue
            f.readline()
            status = int(f.readline().split()[1])
        headers = {}
        while (line := f.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.lower()] = value.strip()
        body = f.read(int(headers.get("content-length", "0")))
        headers.pop("date", None)
        out.append((status, headers, body))
    return out


def exchange(port: int, raw: bytes, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        return read_responses(sock, count)


def requests() -> list[bytes]:
    prompt = system_prompts(FLEET)[0] + [1, 2, 3]
    hashes = [h.hex() for h in prompt_hashes(prompt, FLEET, int64=False)]
    match = json.dumps({"model": FLEET.model, "hashes": hashes, "silent_after_s": WIDE}).encode()
    query = json.dumps({"token_ids": prompt, "model_name": FLEET.model}).encode()
    by_hash = json.dumps({"block_hashes": [1, 2, 3], "model_name": FLEET.model}).encode()
    return [
        post("/v1/match", match, BEARER),
        post("/query", query, BEARER),
        post("/query_by_hash", by_hash, BEARER),
        post("/query", query),  # no token: 401
        post("/v1/match", match, b"authorization: Bearer wrong\r\n"),
        post("/query", b"{not json", BEARER),
        post("/query", json.dumps({"token_ids": "x", "model_name": "m"}).encode(), BEARER),
        post("/query", json.dumps({"token_ids": [1], "model_name": "nope"}).encode(), BEARER),
        post("/query", query, BEARER, length=False),  # chunked, no Content-Length: 411
        post("/v1/match", match, BEARER, length=False),  # 400
        post("/query", b"", BEARER, b"x-pad: 1\r\n"),
        b"GET /openapi.json HTTP/1.1\r\nhost: t\r\n\r\n",  # not hot: the app answers
        post("/query", query, BEARER, b"expect: 100-continue\r\n"),  # uvicorn's own way
    ]


def test_every_request_is_answered_as_uvicorns_own_protocol_answers_it(app: Door) -> None:
    with server(app, hot=True) as hot, server(app, hot=False) as plain:
        statuses = []
        for raw in requests():
            before = REQUESTS.labels("dynamo_query", "200")._value.get()
            a = exchange(hot, raw, 1)
            counted = REQUESTS.labels("dynamo_query", "200")._value.get() - before
            b = exchange(plain, raw, 1)
            assert a == b, raw[:60]
            statuses.append(a[0][0])
            assert counted == (raw.startswith(b"POST /query ") and a[0][0] == 200)
        assert statuses == [200, 200, 200, 401, 401, 400, 422, 404, 411, 400, 400, 200, 200]
        found = json.loads(exchange(hot, requests()[1], 1)[0][2])["instances"]
        assert found and all(s["longest_matched"] for s in found.values()), found


def test_one_connection_keeps_its_answers_in_order_pipelined_or_not(app: Door) -> None:
    """All the requests in one write (pipelined: a hot one may wait behind the app's), then
    one at a time on the same connection: the same answers, in order, as each alone."""
    raws = requests()
    app_answered = raws[11]  # a hot request behind one the app answers must wait for it
    raws = [app_answered, raws[1], app_answered, raws[0], raws[12], raws[2], *raws]
    with server(app, hot=True) as port:
        alone = [exchange(port, raw, 1)[0] for raw in raws]
        assert exchange(port, b"".join(raws), len(raws)) == alone
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for raw, want in zip(raws, alone, strict=True):
                sock.sendall(raw)
                assert read_responses(sock, 1)[0] == want


def test_connection_close_and_http_1_0_end_the_connection(app: Door) -> None:
    raw = requests()[1]
    closing = raw.replace(b"host: t\r\n", b"host: t\r\nconnection: close\r\n")
    old = raw.replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    with server(app, hot=True) as port:
        for request in (closing, old):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request)
                status, headers, _ = read_responses(sock, 1)[0]
                assert status == 200 and headers["connection"] == "close"
                assert sock.recv(1) == b""  # the server closed it


def test_a_malformed_request_is_refused_and_the_server_goes_on(app: Door) -> None:
    with server(app, hot=True) as port:
        bad = exchange(port, b"POST /query HTTP/1.1\r\ncontent-length: x\r\n\r\n", 1)
        assert bad[0][0] == 400
        assert exchange(port, requests()[1], 1)[0][0] == 200


def test_a_route_that_raises_is_a_500_and_the_server_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler's bug is the door's 500 (counted, the connection kept); a bug in the door
    itself is the protocol's own 500, and the connection closed. The server goes on."""
    from kvledger.serving.lookup.table import Body, Route

    def broken(parts: Any, call: Any) -> Any:
        raise RuntimeError("a bug")

    extra = Route("POST", "/broken", "broken", broken, "A bug", {}, role="open",
                  body=Body(1024, 400, 400, {}), run="loop", hot=True)  # fmt: skip
    made = make_app(extra=(extra,))
    assert b"/broken" in made.hot
    with server(made, hot=True) as port:
        before = REQUESTS.labels("broken", "500")._value.get()
        status, headers, body = exchange(port, post("/broken", b"{}"), 1)[0]
        assert (status, json.loads(body)) == (500, {"error": "internal error"})
        assert "connection" not in headers
        assert REQUESTS.labels("broken", "500")._value.get() == before + 1
        assert exchange(port, requests()[1], 1)[0][0] == 200

        def door_bug(*args: Any) -> Any:
            raise RuntimeError("a bug in the door")

        monkeypatch.setattr(made, "answer", door_bug)
        status, headers, body = exchange(port, post("/broken", b"{}"), 1)[0]
        assert (status, headers["connection"], json.loads(body)) == (
            500,
            "close",
            {"error": "internal error"},
        )
        monkeypatch.undo()
        assert exchange(port, requests()[1], 1)[0][0] == 200
