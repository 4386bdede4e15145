"""Lookups over an index filled through the real pipeline, against brute-force answers."""

from __future__ import annotations

import json
import os
import random
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from kvledger.consumer.db import connect
from kvledger.fleet import FleetConfig, prompt_hashes, system_prompts
from kvledger.serving.lookup import Holder, PrefixIndex, rank
from kvledger.serving.lookup.http import ServiceConfig, create_app
from kvledger.simulate_cmd import run_simulation
from tests.helpers.brute_force import (
    BLOCK,
    MODEL,
    brute_force,
    brute_force_hashes,
    chain_by_tokens,
    held_at,
    held_now,
    prompts,
)
from tests.helpers.consuming import by_partition, consume, with_session_setting
from tests.helpers.procs import first_answer, free_port, spawn
from tests.helpers.reference_index import Reference, build

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def filled(request: pytest.FixtureRequest) -> tuple[str, FleetConfig, Reference]:
    """One fleet through Kafka into a fresh database, and the reference model of it."""
    kafka_bootstrap = request.getfixturevalue("kafka_bootstrap")
    database_url = request.getfixturevalue("database_url")
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    from kvledger.consumer.db import create_database, drop_database, migrate

    name = f"kvl_lookup_{uuid.uuid4().hex[:10]}"
    url = create_database(database_url, name)
    migrate(url)
    topic = f"lookup-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 6, 1)])[topic].result(30)
    fleet = FleetConfig(instances=5, requests=80, seed=31)
    sim = run_simulation(kafka_bootstrap, topic, fleet, partitions=6, show_progress=False)
    group = f"lookup-{uuid.uuid4().hex[:8]}"
    consume(kafka_bootstrap, url, topic, group)
    ref = build(by_partition(kafka_bootstrap, topic, group + "-read", sim.produced))
    # These tests check matching over a fleet that has stopped publishing by the time they
    # ask: their sessions get a liveness window that outlasts them (liveness has its own).
    yield with_session_setting(url, "kvledger.silent_after", "1d"), fleet, ref
    admin.delete_topics([topic, f"{topic}.dlq"])
    drop_database(database_url, name)


def test_match_and_match_tokens_agree_with_brute_force(filled) -> None:
    url, fleet, ref = filled
    rng = random.Random(99)
    held = held_now(ref)
    nonempty = partial = partial_by_hash = gapped = 0
    with connect(url, autocommit=True) as conn:
        index = PrefixIndex(conn)
        for tokens in prompts(ref, fleet, rng):
            hashes = prompt_hashes(tokens, fleet)
            want = brute_force(ref, hashes, held)
            assert set(index.match(MODEL, 0, hashes)) == want
            raw = prompt_hashes(tokens, fleet, per_hash=True)
            by_hash = set(index.match(MODEL, 0, raw, granularity="hash"))
            assert by_hash == brute_force_hashes(raw, held)
            # Hash granularity never matches less than block granularity.
            best = {(h.instance, h.medium, h.ownership): h.matched_tokens for h in by_hash}
            assert all(best[(h.instance, h.medium, h.ownership)] >= h.matched_tokens for h in want)
            chain, full = chain_by_tokens(ref, tokens)
            by_tokens = set(index.match_tokens(MODEL, 0, tokens))
            assert by_tokens == {
                Holder(h.instance, h.medium, h.ownership, min(h.matched_blocks, full),
                       h.matched_tokens)
                for h in brute_force(ref, chain, held)
            }  # fmt: skip
            nonempty += bool(want)
            gapped += any(  # a holder that also holds hashes past the end of its run
                (MODEL, 0, later, h.instance, h.medium, h.ownership) in held
                for h in want
                for later in hashes[h.matched_blocks + 1 :]
            )
            partial += any(h.matched_tokens % BLOCK for h in by_tokens)
            partial_by_hash += any(h.matched_tokens % BLOCK for h in by_hash)
    assert nonempty >= 20 and gapped >= 1
    # Partial tails extended matches at hash granularity, by tokens and by hashes.
    assert partial >= 3 and partial_by_hash >= 3


def test_match_by_hash_rejects_unknown_granularity(filled) -> None:
    url, _, _ = filled
    with connect(url, autocommit=True) as conn:
        with pytest.raises(ValueError, match="granularity"):
            PrefixIndex(conn).match(MODEL, 0, [b"x" * 8], granularity="chunk")  # type: ignore[arg-type]
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute("SELECT * FROM kvledger.match_prefix(%s, 0, %s, 'chunk')", (MODEL, [b"x"]))
        # A group without a spec has no hash size: nothing matches by hash.
        assert PrefixIndex(conn).match(MODEL, 7, [b"x" * 8], granularity="hash") == []


def test_match_at_several_instants(filled) -> None:
    url, fleet, ref = filled
    rng = random.Random(5)
    times = sorted({row[-2] for row in ref.history_multiset()})
    instants = [times[int(q * (len(times) - 1))] for q in (0.1, 0.3, 0.5, 0.7, 0.95)]
    candidates = prompts(ref, fleet, rng)
    with connect(url, autocommit=True) as conn:
        index = PrefixIndex(conn)
        for at in instants:
            held = held_at(ref, at)
            for tokens in candidates[:15]:
                hashes = prompt_hashes(tokens, fleet)
                assert set(index.match_at(MODEL, 0, hashes, at)) == brute_force(ref, hashes, held)
                raw = prompt_hashes(tokens, fleet, per_hash=True)
                assert set(index.match_at(MODEL, 0, raw, at, "hash")) == brute_force_hashes(
                    raw, held
                )


def test_removal_on_one_medium_keeps_the_other(filled) -> None:
    url, _, ref = filled
    # Group 0 (the lookups below ask it): the sliding-window group is demoted too.
    held = [k for k in ref.residencies() if k[1] == 0]
    both = {(k[2], k[3]) for k in held if k[4] == "STORAGE"} & {
        (k[2], k[3]) for k in held if k[4] == "CPU"
    }
    only_storage = {(k[2], k[3]) for k in held if k[4] == "STORAGE"} - both
    assert both and only_storage
    with connect(url, autocommit=True) as conn:
        index = PrefixIndex(conn)
        for h, instance in sorted(only_storage):
            media = {(r.instance, r.medium) for r in index.holders(MODEL, 0, h)}
            assert (instance, "STORAGE") in media and (instance, "CPU") not in media


def test_rank_weights_tiers() -> None:
    holders = [
        Holder("a", "CPU", "", 4, 128),
        Holder("a", "STORAGE", "disk", 8, 256),
        Holder("b", "GPU", "", 5, 160),
    ]
    ranked = rank(holders)
    # a: 128 tokens at 0.8 + 128 more at 0.5 = 166.4; b: 160 at 1.0.
    assert [(r.instance, round(r.score, 1)) for r in ranked] == [("a", 166.4), ("b", 160.0)]
    assert rank(holders, {"GPU": 1.0, "CPU": 0.1, "STORAGE": 0.1})[0].instance == "b"


def test_http_bearer_token(filled, as_reader) -> None:
    url = as_reader(filled[0])
    with TestClient(create_app(ServiceConfig(url, pool_size=2, token="s3cret"))) as client:
        assert client.get("/healthz").status_code == 200  # probes need no token
        body = {"model": MODEL, "hashes": ["00" * 8]}
        assert client.post("/v1/match", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.post("/v1/match", json=body, headers=wrong).status_code == 401
        assert client.get("/metrics").status_code == 401
        right = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/match", json=body, headers=right).status_code == 200
        assert client.get("/v1/blocks/" + "00" * 8, headers=right).status_code == 404
        assert client.get("/metrics", headers=right).status_code == 200


def test_http_endpoints(filled, as_reader) -> None:
    url, fleet, _ = filled
    tokens = system_prompts(fleet)[0] + [1, 2, 3]
    hashes = prompt_hashes(tokens, fleet)
    with TestClient(create_app(ServiceConfig(as_reader(url), pool_size=2))) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        by_hash = client.post(
            "/v1/match", json={"model": MODEL, "hashes": [h.hex() for h in hashes]}
        )
        assert by_hash.status_code == 200
        with connect(url, autocommit=True) as conn:
            want = PrefixIndex(conn).match(MODEL, 0, hashes)
        assert {tuple(h.values()) for h in by_hash.json()["holders"]} == {
            (h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens, "live")
            for h in want
        }
        assert by_hash.json()["left_out"] == []
        assert by_hash.json()["ranked"][0]["instance"] == rank(want)[0].instance
        raw = prompt_hashes(tokens, fleet, per_hash=True)
        by_raw = client.post(
            "/v1/match",
            json={"model": MODEL, "hashes": [h.hex() for h in raw], "granularity": "hash"},
        )
        with connect(url, autocommit=True) as conn:
            want_raw = PrefixIndex(conn).match(MODEL, 0, raw, "hash")
        assert [h["matched_tokens"] for h in by_raw.json()["holders"]] == [
            h.matched_tokens for h in want_raw
        ] and want_raw
        by_ints = client.post(
            "/v1/match", json={"model": MODEL, "hashes": [int.from_bytes(h, "big") for h in hashes]}
        )
        assert by_ints.json() == by_hash.json()
        by_tokens = client.post("/v1/match", json={"model": MODEL, "token_ids": tokens})
        assert by_tokens.status_code == 200 and by_tokens.json()["holders"]
        assert "unknown_group" not in by_tokens.json()
        # The liveness window and include_silent apply to token prompts as to hashes.
        for prompt in ({"token_ids": tokens}, {"hashes": [h.hex() for h in hashes]}):
            ask = {"model": MODEL, "silent_after_s": 1e-6, **prompt}
            narrow = client.post("/v1/match", json=ask).json()
            assert narrow["holders"] == [] and narrow["left_out"], prompt
            assert {h["source_state"] for h in narrow["left_out"]} == {"silent"}
            kept = client.post("/v1/match", json={**ask, "include_silent": True}).json()
            assert kept["left_out"] == [] and len(kept["holders"]) == len(narrow["left_out"])
        block = client.get(f"/v1/blocks/{hashes[0].hex()}")
        assert block.status_code == 200
        assert block.json()[0]["token_start"] == 0 and block.json()[0]["holders"]
        # The unsigned-int form /openapi.json documents, and 0x + hex, name the same block.
        as_int = int.from_bytes(hashes[0][-8:], "big")
        assert client.get(f"/v1/blocks/{as_int}").json() == block.json()
        assert client.get(f"/v1/blocks/0x{hashes[0].hex()}").json() == block.json()
        assert client.get(f"/v1/blocks/{'00' * 8}").status_code == 404
        assert client.get(f"/v1/blocks/{10 << 64}").status_code == 400  # odd: no hex
        # A model or group the index has no spec for says so (an empty answer otherwise).
        for body in ({"model": MODEL + "-typo", "token_ids": tokens},
                     {"model": MODEL, "group_idx": 7, "hashes": ["00" * 8]}):  # fmt: skip
            unknown = client.post("/v1/match", json=body)
            assert unknown.status_code == 200 and unknown.json()["holders"] == []
            assert "no group spec for model" in unknown.json()["unknown_group"]
        miss = client.post("/v1/match", json={"model": MODEL, "hashes": ["00" * 8]}).json()
        assert miss["holders"] == [] and "unknown_group" not in miss
        # Routes and methods it does not serve answer JSON too.
        for response, status in ((client.get("/v2/nothing"), 404),
                                 (client.get("/v1/match"), 405)):  # fmt: skip
            assert response.status_code == status and response.json()["error"]
        bad = [
            client.post(
                "/v1/match", content=b"not json", headers={"content-type": "application/json"}
            ),
            client.post("/v1/match", json={"hashes": ["00"]}),
            client.post("/v1/match", json={"model": MODEL}),
            client.post("/v1/match", json={"model": MODEL, "hashes": ["zz"]}),
            client.post("/v1/match", json={"model": MODEL, "hashes": ["00"], "token_ids": [1]}),
            client.post("/v1/match", json={"model": MODEL, "hashes": ["00"] * 9000}),
            client.post("/v1/match", json={"model": MODEL, "token_ids": [1.5]}),
            client.post("/v1/match", json={"model": MODEL, "hashes": ["00"], "at": "2026-01-01"}),
            client.post("/v1/match", json={"model": MODEL, "group_idx": -1, "hashes": ["00"]}),
            client.post("/v1/match", json={"model": MODEL, "hashes": ["00"], "granularity": 2}),
            client.post(
                "/v1/match", json={"model": MODEL, "token_ids": [1], "granularity": "hash"}
            ),
            client.get("/v1/blocks/xyz"),
        ]
        for response in bad:
            assert response.status_code == 400, response.text
            assert "error" in response.json()
        too_big = client.post(
            "/v1/match",
            content=b"{" + b" " * (1 << 20) + b"}",
            headers={"content-type": "application/json"},
        )
        assert too_big.status_code == 400
        metrics = client.get("/metrics").text
        assert 'kvledger_http_requests_total{route="match",status="400"}' in metrics
        # The SQL-backed service applies nothing: no consumer counter stuck at 0.
        assert "kvledger_messages_applied_total" not in metrics
        assert "process_cpu_seconds_total" in metrics


def test_lookup_cli_prints_holders(filled, capsys) -> None:
    from kvledger.cli import main as cli

    url, fleet, _ = filled
    tokens = system_prompts(fleet)[1]
    assert (
        cli(
            [
                "lookup",
                "--database-url",
                url,
                "--model",
                MODEL,
                "--token-ids",
                ",".join(map(str, tokens)),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert ("route to engine-" in out or "-way tie at score" in out) and "CPU" in out
    args = ["lookup", "--database-url", url, "--model", MODEL, "--token-ids",
            ",".join(map(str, tokens))]  # fmt: skip
    # Holders left out as silent are counted, with the way to include them.
    assert cli([*args, "--silent-after", "0.000001"]) == 0
    out = capsys.readouterr().out
    assert "no live instance holds any prefix" in out
    assert "left out: " in out and " silent); --include-silent shows them" in out
    # A mistyped model is not a miss: one line naming what the index lacks, exit status 1.
    args[4] = MODEL + "-typo"
    assert cli(args) == 1
    err = capsys.readouterr().err
    assert f"no group spec for model '{MODEL}-typo' group 0" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"model": "m", "hashes": ["00"], "weights": {"GPU": NaN}}', "not a number"),
        (b'{"model": "m", "hashes": ["00"], "weights": {"GPU": Infinity}}', "not a number"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "m", "group_idx": 1099511627776, "hashes": ["00"]}', "group_idx"),
        (b'{"model": "m\\u0000x", "hashes": ["00"]}', "NUL"),
        (b'{"model": "m", "hashes": ["00"], "shards": 3}', "unknown field"),
        (b'{"model": "m", "token_ids": [1], "at": "2026-01-01T00:00:00+00:00"}', "at applies"),
        (b'{"model": "m", "hashes": ["00"], "at": 5}', "ISO 8601"),
        (b'{"model": "m", "token_ids": [1], "lora_name": "a\\u0000"}', "NUL"),
        (b"\xff\xfe", "not JSON"),
    ],
    ids=["NaN", "Infinity", "deep", "big int", "NUL model", "unknown field", "at+tokens",
         "at type", "NUL lora", "not utf-8"],
)  # fmt: skip
def test_http_hostile_bodies_get_a_400_with_a_reason(
    filled, as_reader, body: bytes, reason: str
) -> None:
    url = as_reader(filled[0])
    with TestClient(create_app(ServiceConfig(url, pool_size=2))) as client:
        response = client.post(
            "/v1/match", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]


def test_http_a_lookup_past_its_statement_timeout_is_a_503(filled, as_reader) -> None:
    url, fleet, _ = filled
    url = as_reader(url)
    tokens = system_prompts(fleet)[0] * 40  # a long token walk over the whole index
    with TestClient(create_app(ServiceConfig(url, pool_size=1, statement_timeout_ms=1))) as client:
        response = client.post("/v1/match", json={"model": MODEL, "token_ids": tokens})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "statement timeout" in response.json()["error"]


def test_serve_over_tls_with_a_token(fresh_database: str, as_reader, tmp_path: Path) -> None:
    """`kvledger serve --tls-cert --tls-key --token-file`: HTTPS only, the token required."""
    cert, key, token = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "token"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    token.write_text("t0ken\n")
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "kvledger", "serve", "--database-url", as_reader(fresh_database),
         "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key),
         "--token-file", str(token)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        base = f"https://127.0.0.1:{port}"
        health = first_answer(f"{base}/healthz", "the TLS service", verify=trust)
        assert health.status_code == 200
        body = {"model": MODEL, "hashes": ["00" * 8]}
        assert httpx.post(f"{base}/v1/match", json=body, verify=trust).status_code == 401
        auth = {"Authorization": "Bearer t0ken"}
        ok = httpx.post(f"{base}/v1/match", json=body, headers=auth, verify=trust)
        assert ok.status_code == 200 and ok.json()["holders"] == []
        with pytest.raises(httpx.TransportError):  # no plain HTTP on that port
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_lookup_role_reads_and_cannot_write(
    fresh_database: str, as_reader, database_url: str, tmp_path: Path
) -> None:
    """The lookup service's login can read and call the lookup functions, and nothing else;
    the service refuses a role that could write instead of quietly using it."""
    from kvledger.consumer.roles import WriterRoleError, can_write

    reader = as_reader(fresh_database)
    with connect(reader, autocommit=True) as conn:
        assert not can_write(conn)
        assert PrefixIndex(conn).match(MODEL, 0, [b"\x00" * 8]) == []
        for statement in (
            "INSERT INTO kvledger.group_specs (model, group_idx, kind, block_size, "
            "hash_block_size) VALUES ('x', 0, 'full_attention', 16, 16)",
            "DELETE FROM kvledger.events",
            "TRUNCATE kvledger.blocks",
            "CREATE TABLE kvledger.intruder (x int)",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    with connect(fresh_database, autocommit=True) as conn:
        assert can_write(conn)
    with (
        pytest.raises(WriterRoleError, match="can write"),
        TestClient(create_app(ServiceConfig(fresh_database))),
    ):
        pass
    refused = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", "--database-url", fresh_database,
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 1 and "can write to the index" in refused.stderr

    # `kvledger roles create-reader`: a new login, its password from the environment.
    admin = os.environ.get("KVLEDGER_ADMIN_DATABASE_URL", database_url)
    name = f"kvl_reader_{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, KVLEDGER_READER_PASSWORD="pw-" + name)
    made = subprocess.run(
        [sys.executable, "-m", "kvledger", "roles", "create-reader", name,
         "--admin-database-url", admin, "--database-url", fresh_database],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    # Run again (as `roles create-reader` with no name would be): refused, the login kept.
    again = subprocess.run(
        [sys.executable, "-m", "kvledger", "roles", "create-reader", name,
         "--admin-database-url", admin, "--database-url", fresh_database],
        env=dict(env, KVLEDGER_READER_PASSWORD="other"), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert again.returncode == 1 and "exists already: pass --reset-password" in again.stderr
    # Without an admin URL the owner is asked, and an owner that may not create roles
    # (scripts/services' is not) is one line saying what to pass, not a traceback.
    with connect(fresh_database, autocommit=True) as conn:
        owner_creates_roles = conn.execute(
            "SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone() == (True,)
    if not owner_creates_roles:
        no_admin = {k: v for k, v in env.items() if k != "KVLEDGER_ADMIN_DATABASE_URL"}
        refused = subprocess.run(
            [sys.executable, "-m", "kvledger", "roles", "create-reader", name + "x",
             "--database-url", fresh_database],
            env=no_admin, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode == 1 and "may not create roles" in refused.stderr
        assert "Traceback" not in refused.stderr
    login = sa.engine.make_url(fresh_database).set(username=name, password="pw-" + name)
    try:
        with connect(login.render_as_string(hide_password=False), autocommit=True) as conn:
            assert not can_write(conn)
            assert conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone() == (0,)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("DELETE FROM kvledger.blocks")
        with TestClient(
            create_app(ServiceConfig(login.render_as_string(hide_password=False)))
        ) as client:
            assert client.get("/healthz").status_code == 200
    finally:
        with connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{name}"')


def test_the_openapi_document_and_the_client_match_the_service(filled, as_reader) -> None:
    """GET /openapi.json is a valid OpenAPI 3.1 document, every answer the service gives
    validates against its schemas, and kvledger.client reads the same answers the Python
    API gives."""
    import json

    from kvledger.client import LookupClient, LookupServiceError
    from kvledger.serving.lookup.table import document
    from tests.helpers.openapi import conformance

    spec = document(dynamo_api=False)
    conforms = conformance(spec)

    url, fleet, _ = filled
    tokens = system_prompts(fleet)[0] + [7, 8, 9]
    hashes = prompt_hashes(tokens, fleet)
    port = free_port()
    spawn(
        [sys.executable, "-m", "kvledger", "serve", "--database-url", as_reader(url),
         "--port", str(port)],
        env=dict(os.environ, KVLEDGER_LOOKUP_TOKEN="tok"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    assert first_answer(f"{base}/healthz", "the service").status_code == 200
    document = httpx.get(f"{base}/openapi.json")  # no token needed, like /healthz
    assert document.status_code == 200 and document.json() == json.loads(json.dumps(spec))
    auth = {"Authorization": "Bearer tok"}
    raw = httpx.post(
        f"{base}/v1/match", headers=auth,
        json={"model": MODEL, "hashes": [h.hex() for h in hashes], "include_silent": True},
    )  # fmt: skip
    conforms(raw.json(), "MatchAnswer")
    assert raw.json()["holders"]
    bad = httpx.post(f"{base}/v1/match", headers=auth, json={"model": MODEL})
    assert bad.status_code == 400
    conforms(bad.json(), "Error")
    conforms(httpx.get(f"{base}/healthz").json(), "Health")

    with connect(url, autocommit=True) as conn:
        index = PrefixIndex(conn)
        want = index.match(MODEL, 0, hashes, include_silent=True)
        want_tokens = index.match_tokens(MODEL, 0, tokens, include_silent=True)
        rows = index.blocks(hashes[0])
    with LookupClient(base, token="tok") as client:
        assert client.healthz() == {"status": "ok"}
        answer = client.match(MODEL, hashes=hashes, include_silent=True)
        got = [(h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens)
               for h in answer.holders]  # fmt: skip
        assert got == [(h.instance, h.medium, h.ownership, h.matched_blocks, h.matched_tokens)
                       for h in want]  # fmt: skip
        assert [r.instance for r in answer.ranked] == [r.instance for r in rank(want)]
        by_tokens = client.match(MODEL, token_ids=tokens, include_silent=True)
        assert [h.matched_tokens for h in by_tokens.holders] == [
            h.matched_tokens for h in want_tokens
        ]
        blocks = client.blocks(hashes[0])
        assert [(b.block_hash, b.block_size, len(b.holders)) for b in blocks] == [
            (b.block_hash, b.block_size, len(b.holders)) for b in rows
        ]
        raw_blocks = httpx.get(f"{base}/v1/blocks/{hashes[0].hex()}", headers=auth).json()
        for row in raw_blocks:
            conforms(row, "Block")
        assert client.blocks(b"\x00" * 8) == []
        with pytest.raises(LookupServiceError) as refused:
            client.match(MODEL, hashes=[b"\x01" * 8], token_ids=[1])
        assert refused.value.status == 400 and "exactly one" in refused.value.reason
    with LookupClient(base) as anonymous, pytest.raises(LookupServiceError) as no_token:
        anonymous.match(MODEL, hashes=hashes)
    assert no_token.value.status == 401


def test_an_admin_with_createrole_alone_can_make_and_remake_the_reader(
    fresh_database: str, database_url: str
) -> None:
    """`roles create-reader` needs CREATEROLE, not a superuser, also when it runs again on
    an existing login (an ALTER that named SUPERUSER would need one)."""
    from kvledger.consumer.roles import RoleExistsError, create_reader

    superuser = os.environ.get("KVLEDGER_ADMIN_DATABASE_URL", database_url)
    admin = f"kvl_admin_{uuid.uuid4().hex[:8]}"
    with connect(superuser, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {admin} LOGIN CREATEROLE PASSWORD 'admin-pw'")
        conn.execute(f"GRANT kvledger_reader TO {admin} WITH ADMIN OPTION")
    url = sa.engine.make_url(fresh_database).set(username=admin, password="admin-pw")
    try:
        admin_url = url.render_as_string(hide_password=False)
        assert create_reader(admin_url, fresh_database, "first", f"{admin}_r")
        with pytest.raises(RoleExistsError):  # an existing login keeps its password
            create_reader(admin_url, fresh_database, "second", f"{admin}_r")
        assert create_reader(admin_url, fresh_database, "second", f"{admin}_r", reset_password=True)
        login = sa.engine.make_url(fresh_database).set(username=f"{admin}_r", password="second")
        with connect(login.render_as_string(hide_password=False), autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM kvledger.blocks").fetchone() == (0,)
    finally:
        with connect(superuser, autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS {admin}_r")
            conn.execute(f"DROP ROLE {admin}")


def test_json_logs_are_json_from_uvicorn_too(fresh_database: str, as_reader) -> None:  # type: ignore[no-untyped-def]
    """`--log-format json serve` still let uvicorn print its own plain lines (issue 48's
    item 10): every line on stderr is a JSON object now, uvicorn's included."""
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "kvledger", "--log-format", "json", "serve", "--database-url",
         as_reader(fresh_database), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert first_answer(f"http://127.0.0.1:{port}/healthz", "the service").status_code == 200
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    lines = err.splitlines()
    records = [json.loads(line) for line in lines]  # raises on a line that is not JSON
    # uvicorn's own start-up line, logged as the service's (not ``uvicorn.error``)
    started = [r for r in records if r["message"].startswith("Started server process")]
    assert [r["logger"] for r in started] == ["kvledger.serve"], lines
