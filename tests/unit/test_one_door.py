"""One door per route (serving/lookup/door.py, table.py): every route of the table is
served through the one door and described by the OpenAPI document, nothing else is served
or described, and the gate refuses a missing or wrong token, a body without a length and
an oversized one the same way on every route, over ASGI and in the HTTP parser's callbacks
alike. A router index filled through the pipeline, no services."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvledger.serving.lookup.door import Door
from kvledger.serving.lookup.table import Route, routes
from tests.unit.test_hot_protocol import exchange, make_app, post, server

GOOD = {"authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def app() -> Door:
    return make_app()


def path_of(route: Route) -> str:
    return route.path.replace("{block_hash}", "00" * 8)


def test_the_tables_routes_are_the_served_and_the_documented(app: Door) -> None:
    table = {(r.method, r.path) for r in app.table.routes}
    assert table == {(r.method, r.path) for r in routes(dynamo_api=True)}
    with TestClient(app) as client:
        document = client.get("/openapi.json").json()
        documented = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
        assert documented == table
        assert set(client.get("/").json()["routes"]) == {f"{m} {p}" for m, p in table}
        for route in app.table.routes:
            answer = client.request(route.method, path_of(route), headers=GOOD, content=b"{}")
            assert answer.status_code not in (404, 405) or answer.json()["error"] not in (
                "Not Found",
                "Method Not Allowed",
            ), route.path
            wrong = "POST" if route.method == "GET" else "GET"
            if (wrong, route.path) not in table:
                refused = client.request(wrong, path_of(route), headers=GOOD)
                assert refused.status_code == 405, route.path
        assert client.get("/v2/nothing").json() == {"error": "Not Found"}


def test_every_route_refuses_a_token_and_a_body_the_same_way(app: Door) -> None:
    closed = [r for r in app.table.routes if r.role != "open"]
    assert {r.path for r in closed} >= {"/v1/match", "/v1/decisions", "/metrics", "/query"}
    with TestClient(app) as client:
        for route in closed:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                answer = client.request(route.method, path_of(route), headers=headers)
                assert (answer.status_code, answer.json()) == (
                    401,
                    {"error": "a bearer token is required"},
                ), route.path
                assert answer.headers["www-authenticate"] == "Bearer"
        for route in (r for r in app.table.routes if r.body is not None):
            body = route.body
            assert body is not None
            over = client.post(route.path, headers=GOOD, content=b" " * (body.max_bytes + 1))
            assert (over.status_code, over.json()) == (
                body.over,
                {"error": f"body over {body.max_bytes} bytes"},
            ), route.path
            unsized = client.post(route.path, headers=GOOD, content=iter([b"{}"]))
            assert (unsized.status_code, unsized.json()) == (
                body.missing,
                {"error": "a JSON body with Content-Length is required"},
            ), route.path


def test_the_parser_path_refuses_as_the_asgi_path(app: Door) -> None:
    """The hot routes' refusals in the parser's callbacks are the ASGI path's, byte for
    byte (a route's whole refusal, from the same gate)."""
    assert {r.path for r in app.hot.values()} == {"/v1/match", "/query", "/query_by_hash"}
    with server(app, hot=True) as hot, server(app, hot=False) as plain:
        for path in (b"/v1/match", b"/query", b"/v1/decisions", b"/register"):
            for raw in (
                post(path.decode(), b"{}"),
                post(path.decode(), b"{}", b"authorization: Bearer wrong\r\n"),
                post(path.decode(), b"{}", b"authorization: Bearer s3cret\r\n", length=False),
            ):
                assert exchange(hot, raw, 1) == exchange(plain, raw, 1), raw[:60]


def test_a_route_bounded_at_once_leaves_the_pool_to_the_others() -> None:
    """Sixty requests to a route answered at most two at a time, each held until let go:
    two handlers run, the rest wait without a thread, and a request to another route is
    answered meanwhile (issue 76's dashboard flood took every thread from the lookups)."""
    import asyncio
    import threading

    from kvledger.serving.lookup.door import Gate
    from kvledger.serving.lookup.table import Table

    release, running, most = threading.Event(), [0], [0]
    lock = threading.Lock()

    def slow(_parts: object, _call: object) -> tuple[int, object, dict[str, str]]:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1
        return 200, {"slow": True}, {}

    def route(path: str, handler: object, at_once: int | None = None) -> Route:
        return Route("GET", path, path.strip("/"), handler, path, {}, role="open",  # type: ignore[arg-type]
                     counted=False, at_once=at_once)  # fmt: skip

    table = Table((route("/slow", slow, at_once=2), route("/quick", lambda p, c: (200, {}, {}))))
    door = Door(table, Gate({}, {}), None, False, (lambda: None, lambda: None))

    async def get(path: str) -> int:
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": [],
                 "query_string": b"", "client": ("127.0.0.1", 1)}  # fmt: skip
        await door(scope, receive, send)  # type: ignore[arg-type]
        return int(sent[0]["status"])  # type: ignore[call-overload]

    async def flood() -> None:
        slow_ones = [asyncio.create_task(get("/slow")) for _ in range(60)]
        await asyncio.sleep(0.3)
        assert await asyncio.wait_for(get("/quick"), 5) == 200
        assert running[0] == 2
        release.set()
        assert await asyncio.gather(*slow_ones) == [200] * 60

    asyncio.run(flood())
    assert most[0] == 2
