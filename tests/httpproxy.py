"""The HTTP plumbing the tests' registry proxies share (tests/fetch/proxies.py, tests/faults/proxy.py).

- `QuietServer`: a threaded server that does not print the disconnects and resets its tests cause.
- `send_simple` / `reset_connection`: answer a request whole, or abort it with a TCP RST.
- `forward`: send a request on to the upstream registry and read its whole answer.
- `send_forwarded`: answer with a forwarded response, optionally damaged the ways the fault tests
  need (Content-Range shifted, body cut short, connection reset half way through the body).
"""

from __future__ import annotations

import http.client
import socket
import struct
import sys
from collections.abc import Collection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Hop-by-hop headers, and the length and encoding that `send_forwarded` sets itself.
_NOT_FORWARDED = ("content-length", "transfer-encoding", "connection", "keep-alive")
_UPSTREAM_LENGTH = "x-upstream-content-length"  # a HEAD answer's Content-Length, carried to send_forwarded


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up (TLS probes, resets we injected) are expected here.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def send_simple(h: BaseHTTPRequestHandler, status: int, body: bytes = b"",
                headers: dict[str, str] | None = None) -> None:
    h.send_response(status)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


def reset_connection(h: BaseHTTPRequestHandler) -> None:
    """Abort the connection with a TCP RST (a client that already went is fine)."""
    try:
        h.wfile.flush()
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    h.close_connection = True
    h.connection.close()


def forward(upstream: str, h: BaseHTTPRequestHandler, body: bytes, *,
            drop: Collection[str] = ()) -> tuple[int, dict[str, str], bytes]:
    """Send `h`'s request to `upstream` ("HOST:PORT") without the hop-by-hop headers and those named
    in `drop` (lowercase); returns (status, lowercased headers for `send_forwarded`, body)."""
    conn = http.client.HTTPConnection(upstream, timeout=30)
    try:
        skip = {"connection", "keep-alive", *drop}
        headers = {k: v for k, v in h.headers.items() if k.lower() not in skip}
        conn.request(h.command, h.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        out = {k.lower(): v for k, v in resp.getheaders() if k.lower() not in _NOT_FORWARDED}
        if h.command == "HEAD":
            out[_UPSTREAM_LENGTH] = resp.getheader("Content-Length") or "0"
        return resp.status, out, data
    finally:
        conn.close()


def send_forwarded(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes, *,
                   range_shift: int = 0, cut: int = 0, reset_mid_body: bool = False) -> None:
    """Answer `h` with what `forward` returned. range_shift: move both ends of a Content-Range by
    that many bytes (a wrong range answer); cut: drop that many bytes from the body's end (with a
    Content-Length that matches); reset_mid_body: send half of the body, then a TCP RST."""
    headers = dict(headers)
    head_length = headers.pop(_UPSTREAM_LENGTH, "0")
    if range_shift and "content-range" in headers:
        unit, _, rest = headers["content-range"].partition(" ")
        span, _, total = rest.partition("/")
        first, _, last = span.partition("-")
        headers["content-range"] = f"{unit} {int(first) + range_shift}-{int(last) + range_shift}/{total}"
    if cut:
        body = body[:max(len(body) - cut, 0)]
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    if h.command == "HEAD":
        h.send_header("Content-Length", head_length)
        h.end_headers()
        return
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if reset_mid_body:
        h.wfile.write(body[:len(body) // 2])
        reset_connection(h)
        return
    h.wfile.write(body)
