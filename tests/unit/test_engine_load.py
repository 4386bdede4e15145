"""The relay's reading of an engine's load (producer/relay/load.py): vLLM's gauges per
engine core, and a metrics route that is slow, huge or not metrics at all costing the relay
nothing but the reading."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from kvledger.producer.relay.config import RelayConfig
from kvledger.producer.relay.load import MAX_BYTES, Load, LoadReader, parse_load

# As vLLM 0.32's /metrics prints them (prometheus_client's text format), two engine cores.
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="lab"} 3.0
vllm:num_requests_running{engine="1",model_name="lab"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="lab"} 2.0
vllm:num_requests_waiting{engine="1",model_name="lab"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
vllm:num_requests_waiting_by_reason{engine="0",model_name="lab",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="lab"} 0.25
"""


def test_the_gauges_of_one_engine_core_or_of_all() -> None:
    assert parse_load(PAGE, rank=0) == Load(3, 2)
    assert parse_load(PAGE, rank=1) == Load(1, 0)
    assert parse_load(PAGE) == Load(4, 2)
    assert parse_load(PAGE, rank=2) is None  # no such core
    assert parse_load("vllm:num_requests_running 5\n") == Load(5, 0)


@pytest.mark.parametrize(
    "page",
    [
        "",
        "<html>not metrics</html>",
        'vllm:num_requests_running{engine="0"} NaN\n',
        'vllm:num_requests_running{engine="0"} -1\n',
        'vllm:num_requests_running{engine="0"} +Inf\n',
        'vllm:num_requests_running{engine="0"} many\n',
        'vllm:num_requests_running{engine="0" 3\n',
        "vllm:num_requests_waiting 1e12\n",
    ],
)
def test_a_page_that_is_not_a_reading_is_none(page: str) -> None:
    assert parse_load(page) is None


class _Route(http.server.BaseHTTPRequestHandler):
    body = PAGE.encode()
    delay = 0.0

    def do_GET(self) -> None:
        time.sleep(type(self).delay)
        self.send_response(200)
        self.send_header("Content-Length", str(len(type(self).body)))
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def route() -> Iterator[tuple[str, type[_Route]]]:
    handler = type("Route", (_Route,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/metrics", handler
    server.shutdown()
    server.server_close()


def test_the_reader_keeps_the_latest_reading_while_it_is_fresh(
    route: tuple[str, type[_Route]],
) -> None:
    url, _ = route
    now = [100.0]
    errors: list[int] = []
    reader = LoadReader(url, 1.0, rank=0, on_error=lambda: errors.append(1),
                        clock=lambda: now[0])  # fmt: skip
    assert reader.latest() is None
    assert reader.read_once() == Load(3, 2)
    now[0] += 2.0
    assert reader.latest() == Load(3, 2)
    now[0] += 0.5  # older than two intervals: no reading at all rather than a stale one
    assert reader.latest() is None and not errors


def test_a_huge_slow_or_junk_route_is_no_reading_and_counted(
    route: tuple[str, type[_Route]],
) -> None:
    url, handler = route
    errors: list[int] = []
    reader = LoadReader(url, 1.0, timeout_s=0.3, on_error=lambda: errors.append(1))
    handler.body = b"vllm:num_requests_running 1\n" + b"#" * MAX_BYTES
    assert reader.read_once() is None
    handler.body = b"\xff\xfe garbage"
    assert reader.read_once() is None
    handler.body, handler.delay = PAGE.encode(), 1.0
    began = time.monotonic()
    assert reader.read_once() is None
    assert time.monotonic() - began < 0.9  # the timeout, not the route, decides
    handler.delay = 0.0
    reader.read_once()  # the handler's sleeping thread may still be writing: any answer
    assert len(errors) == 3 and reader.read_once() == Load(4, 2)
    reader = LoadReader("http://127.0.0.1:9/metrics", 1.0, on_error=lambda: errors.append(1))
    assert reader.read_once() is None and len(errors) == 4  # nothing listening


def test_the_reader_runs_on_its_own_thread_until_stopped(
    route: tuple[str, type[_Route]],
) -> None:
    url, _ = route
    reader = LoadReader(url, 0.1, rank=1)
    reader.start()
    try:
        deadline = time.monotonic() + 5
        while reader.latest() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reader.latest() == Load(1, 0)
    finally:
        reader.stop()
    assert reader._thread is not None and not reader._thread.is_alive()


def test_the_metrics_url_is_checked_before_the_relay_starts() -> None:
    base = ("tcp://127.0.0.1:5557", "s", "m", "b:9092")
    with pytest.raises(ValueError, match=r"--engine-metrics-url .*expected http"):
        RelayConfig(*base, engine_metrics_url="127.0.0.1:8000/metrics")
    with pytest.raises(ValueError, match="vLLM's metrics"):
        RelayConfig(*base, engine="sglang", engine_metrics_url="http://e:8000/metrics")
    with pytest.raises(ValueError, match="heartbeat-interval above 0"):
        RelayConfig(*base, heartbeat_interval_s=0, engine_metrics_url="http://e:8000/metrics")
    RelayConfig(*base, engine_metrics_url="http://e:8000/metrics")
