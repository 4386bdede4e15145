"""The relay's outbound HTTP (an engine's health and metrics routes): one GET under a
deadline for the whole request — connecting, the answer's head and its body — so that a
server that answers a byte at a time cannot hold the caller past it (a timeout per read
would). HTTP/1.0 and ``Connection: close``: the body ends where the connection does."""

from __future__ import annotations

import socket
import ssl
import time
from urllib.parse import urlsplit


def get(url: str, deadline_s: float, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of ``GET url``; ``TimeoutError`` past ``deadline_s`` in all,
    ``ValueError`` for an answer that is not HTTP or a body over ``max_bytes``, ``OSError``
    for the rest (refused, reset, a name that does not resolve)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    end = time.monotonic() + deadline_s

    def left() -> float:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{url}: no whole answer within {deadline_s:g} s")
        return remaining

    sock: socket.socket = socket.create_connection((parts.hostname, port), timeout=left())
    try:
        if parts.scheme == "https":
            sock.settimeout(left())
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        sock.settimeout(left())
        sock.sendall(
            f"GET {path} HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode("latin-1")
        )
        data = bytearray()
        head_limit = max_bytes + 65_536  # the head's room beside the body's
        while True:
            sock.settimeout(left())
            chunk = sock.recv(65_536)
            if not chunk:
                break
            data += chunk
            if len(data) > head_limit:
                break
    finally:
        sock.close()
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise ValueError(f"{url}: not an HTTP answer")
    if not status_line[1].isdigit():
        raise ValueError(f"{url}: a status of {status_line[1][:20]!r}")
    if len(body) > max_bytes:
        raise ValueError(f"{url}: more than {max_bytes} bytes")
    return int(status_line[1]), body
