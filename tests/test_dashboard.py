"""The dashboard (GET /ui) in a real browser: Debian's chromium, driven by Selenium through
its chromedriver (scripts/browser installs them), against `kvledger serve` over a seeded
index behind a bearer token. The page asks for the token, then every chart draws the series
the database holds (read from the charts' own data), every name is shown as text, and the
browser's console has no error. A screenshot of the page and of each view is kept under
test-artifacts/ (or $KVLEDGER_TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvledger.consumer.db import connect
from kvledger.producer.config import PublisherConfig
from kvledger.producer.publisher import KVEventPublisher
from kvledger.schemas.events import BlockStored, GroupSpec
from tests.helpers.browser import chromium, missing
from tests.helpers.consuming import consume
from tests.helpers.procs import first_answer, free_port, spawn, until

pytestmark = pytest.mark.integration

MODEL, BLOCK, TOKEN = "m-dashboard", 4, "dashboard-secret"
HOSTILE = '<img src=x onerror="window.pwned=1">'  # an engine name is untrusted text
ARTIFACTS = Path(os.environ.get("KVLEDGER_TEST_ARTIFACTS", "test-artifacts"))
CHARTS = ["chart-blocks", "chart-occupancy", "chart-funnel", "chart-outcomes", "chart-timeline"]


def stored(tag: int, n: int, medium: str = "GPU") -> BlockStored:
    hashes = tuple((tag * 1000 + j).to_bytes(8, "big") for j in range(n))
    return BlockStored(hashes, None, tuple(range(tag * 100, tag * 100 + n * BLOCK)), BLOCK,
                       None, medium, None, group_idx=0, token_start=0)  # fmt: skip


@pytest.fixture
def browser() -> Iterator[Any]:
    if (why := missing()) is not None:
        if os.environ.get("CI"):
            raise AssertionError(f"{why}: CI needs them")
        pytest.skip(why)
    with chromium() as driver:
        yield driver


def severe(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def seed(bootstrap: str, topic: str, db: str, group: str) -> None:
    """Three engines (one named with markup) holding blocks on two tiers, one restart, and
    decisions with every outcome in this minute."""
    names = ["engine-a", "engine-b", HOSTILE]
    for i, name in enumerate(names):
        pub = KVEventPublisher(PublisherConfig(bootstrap, name, MODEL, topic=topic,
                                               heartbeat_interval_s=0))  # fmt: skip
        pub.announce_group_spec(GroupSpec(MODEL, 0, "full_attention", BLOCK, BLOCK))
        pub.publish_events([stored(1, 6 - i), stored(10 + i, 3, "CPU")])
        if i == 0:  # a restart: a new epoch, the old blocks gone
            pub.flush()
            pub.new_epoch(pub.epoch + 1)
            pub.publish_events([stored(1, 4)])
        pub.flush()
    consume(bootstrap, db, topic, group)
    rows = [  # chosen, available, captured, tier, silent, captured hashes (delivered)
        ("engine-a", 6, 4, "GPU", 0, 4),
        ("engine-a", 6, 6, "GPU", 0, None),
        ("engine-b", 5, 5, "GPU", 0, 5),
        ("engine-b", 0, 0, None, 2, None),
        ("engine-b", 0, 0, None, 0, None),
        ("engine-a", 3, 3, "CPU", 0, None),
        (None, 4, None, None, 0, None),  # a Dynamo answer: no choice reported
    ]
    with connect(db, autocommit=True) as conn:
        for k, (chosen, available, captured, tier, silent, hashes) in enumerate(rows):
            kept = [(1000 + j).to_bytes(8, "big") for j in range(hashes)] if hashes else None
            conn.execute(
                "INSERT INTO kvledger.decisions (decision_id, decided_at, model, group_idx, "
                "origin, chosen, chosen_state, block_size, prompt_blocks, available_blocks, "
                "captured_blocks, captured_tier, silent_blocks, captured_hashes, offered, "
                "kafka_topic, kafka_partition, kafka_offset) VALUES (%s, now(), %s, 0, 'seed', "
                "%s, %s, %s, 8, %s, %s, %s, %s, %s, '[]', 'seed', 0, %s)",
                (uuid.uuid4(), MODEL, chosen, chosen and "live", BLOCK, available, captured,
                 tier, silent, kept, k),
            )  # fmt: skip


def test_the_dashboard_draws_the_index_in_a_real_browser(
    browser, kafka_bootstrap, fresh_database, as_reader, make_topic, group_id, tmp_path
) -> None:
    topic = make_topic("dashboard")
    seed(kafka_bootstrap, topic, fresh_database, group_id)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the child writes it
    (tmp_path / "token").write_text(TOKEN)
    serve = spawn([sys.executable, "-m", "kvledger", "serve", "--database-url",
           as_reader(fresh_database), "--port", str(port), "--token-file",
           str(tmp_path / "token")],
          stdout=log, stderr=log)  # fmt: skip
    try:
        first_answer(f"{url}/healthz", "kvledger serve", timeout=60)
        check(browser, url, fresh_database)
    finally:
        serve.terminate()
        serve.wait(30)


def check(browser: Any, url: str, fresh_database: str) -> None:
    # Over HTTP: the page holds no data; the data needs the token; a bad window is a 400.
    assert httpx.get(f"{url}/ui").status_code == 200
    assert httpx.get(f"{url}/v1/dashboard").status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = httpx.get(f"{url}/v1/dashboard?minutes=0", headers=auth)
    assert bad.status_code == 400 and "minutes" in bad.json()["error"]
    data = httpx.get(f"{url}/v1/dashboard", headers=auth).json()
    with connect(fresh_database, autocommit=True) as conn:  # occupancy, counted directly
        direct = conn.execute(
            "WITH m AS (SELECT generate_series(date_trunc('minute', %(now)s::timestamptz - "
            "interval '60 minutes'), date_trunc('minute', %(now)s::timestamptz), "
            "interval '1 minute') + interval '1 minute' AS t) "
            "SELECT m.t, h.instance, h.medium, count(*) FROM m JOIN kvledger.residency_history h "
            "ON h.stored_at <= m.t AND (h.removed_at IS NULL OR h.removed_at > m.t) "
            "GROUP BY 1, 2, 3", {"now": data["now"]},
        ).fetchall()  # fmt: skip
    assert {(o["t"], o["instance"], o["medium"]): o["blocks"] for o in data["occupancy"]} == {
        (t.astimezone(UTC).isoformat(), i, m): n for t, i, m, n in direct
    }

    browser.get(f"{url}/ui")
    form = until("the token form", lambda: browser.find_element("id", "token-form"))
    until("the form shown", form.is_displayed)
    severe(browser)  # the page's first ask was refused (401): that line is expected
    browser.find_element("id", "token").send_keys(TOKEN)
    form.submit()
    until("the first draw", lambda: browser.execute_script(
        "return window.kvledgerDashboard.state.last !== null"))  # fmt: skip
    charts: dict[str, Any] = browser.execute_script("""
        const out = {};
        for (const [id, c] of Object.entries(window.kvledgerDashboard.charts)) {
          out[id] = {labels: c.data.labels, datasets: Object.fromEntries(
            c.data.datasets.map((d) => [d.label, d.data]))};
        }
        return out;""")
    assert sorted(charts) == sorted(CHARTS)

    fleet = sorted(data["fleet"], key=lambda s: s["source"])
    assert [s["source"] for s in fleet] == sorted(["engine-a", "engine-b", HOSTILE])
    blocks = charts["chart-blocks"]
    assert blocks["labels"] == [f"{s['source']} ({MODEL})" for s in fleet]
    held = {"engine-a": (4, 0), "engine-b": (5, 3), HOSTILE: (4, 3)}  # a's CPU: an old epoch
    assert blocks["datasets"]["GPU"] == [s["held"]["GPU"] for s in fleet]
    assert blocks["datasets"]["GPU"] == [held[s["source"]][0] for s in fleet]
    assert blocks["datasets"]["CPU"] == [held[s["source"]][1] for s in fleet]

    with connect(fresh_database, autocommit=True) as conn:
        sums = conn.execute(
            "SELECT sum(available_blocks), sum(captured_blocks), sum(delivered_blocks), "
            "sum(captured), sum(chosen_elsewhere), sum(no_holder), sum(holder_silent), "
            "sum(lower_tier_only), sum(unreported) FROM kvledger.decision_funnel"
        ).fetchone()  # fmt: skip
    funnel = charts["chart-funnel"]["datasets"]
    got = [sum(funnel["available"]), sum(funnel["captured"]), sum(funnel["delivered"])]
    assert got == [int(x) for x in sums[:3]] == [20, 18, 9]  # delivered: 4 + 5, known
    outcomes = charts["chart-outcomes"]["datasets"]
    assert [sum(outcomes[o]) for o in ("captured", "chosen_elsewhere", "no_holder",
                                       "holder_silent", "lower_tier_only", "unreported")] == [
        int(x) for x in sums[3:]] == [2, 1, 1, 1, 1, 1]  # fmt: skip
    assert "restart" in charts["chart-timeline"]["datasets"]
    occupancy = charts["chart-occupancy"]["datasets"]
    assert occupancy["engine-b GPU"][-1] == 5 and occupancy["engine-a GPU"][-1] == 4

    # Names are text: the markup-named engine is a cell's text, and nothing ran.
    cells = browser.execute_script(
        "return [...document.querySelectorAll('#fleet tbody td:first-child')]"
        ".map((td) => td.textContent)")  # fmt: skip
    assert HOSTILE in cells
    assert browser.execute_script("return document.querySelectorAll('main img').length") == 0
    assert browser.execute_script("return window.pwned === undefined")
    assert severe(browser) == []

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    for i, section in enumerate(browser.find_elements("css selector", "main section")):
        section.screenshot(str(ARTIFACTS / f"dashboard-view-{i}.png"))
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
