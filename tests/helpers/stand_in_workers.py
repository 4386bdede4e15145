"""HTTP stand-ins for vLLM engines' serving side, for tests of a router's choice (vllm-router
in front of scripted engines whose events come from vLLM's own publisher).

A router that tokenizes through its workers asks ``POST /v1/completions/render`` (vLLM's
scale-out route: a list of ``{request_id, token_ids}``); here a prompt is its token ids
written as decimal words, and render reads them back. ``POST /v1/completions`` records the
prompt's token ids (the router chose this worker) and answers one token. ``GET /health``
and ``GET /v1/models`` answer as an engine does. Closing a worker refuses its port, as a
dead engine's does.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.helpers.procs import free_port


class Worker:
    """One engine's HTTP side: what the router sent it (token ids of each completion)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.port = free_port()
        self.completions: list[tuple[int, ...]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """The engine died: its port refuses connections."""
        self._server.shutdown()
        self._server.server_close()


def prompt_text(token_ids: list[int]) -> str:
    return " ".join(map(str, token_ids))


def _handler(worker: Worker) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _answer(self, body: Any, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.startswith("/v1/models"):
                self._answer({"object": "list", "data": [{"id": worker.model, "object": "model"}]})
            else:
                self._answer({})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            prompt = request.get("prompt", "")
            tokens = prompt if isinstance(prompt, list) else [int(w) for w in prompt.split()]
            if self.path == "/v1/completions/render":
                self._answer([{"request_id": "stand-in", "token_ids": tokens}])
            elif self.path == "/v1/completions":
                worker.completions.append(tuple(tokens))
                self._answer({
                    "id": "stand-in", "object": "text_completion", "model": worker.model,
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": len(tokens), "completion_tokens": 1,
                              "total_tokens": len(tokens) + 1},
                })  # fmt: skip
            else:
                self._answer({"error": f"no route {self.path}"}, 404)

    return Handler
