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
