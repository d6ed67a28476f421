"""A controllable HTTP proxy in front of the lab registry, for the fault suite.

Only the snapshotter daemon (and its mount processes) talk to it: the lab's daemon config points
`registry.config_path` at a hosts dir whose `hosts.toml` for the registry names this proxy as the
server; containerd keeps talking to the registry directly. So faults hit lazy resolves and lazy
reads, never containerd's own downloads.

Controls (all thread-safe):
- `stop()` / `start()`: close the listening socket (connection refused) and reopen it on the same
  port: the registry is "down".
- `add(Rule(...))`: a fault applied to the next `times` requests (default: every one) whose
  method matches and whose path contains `path`. Actions:
    "status"   answer `status` (401/404/500/503...) without forwarding
    "delay"    sleep `seconds`, then forward
    "hang"     sleep `seconds` (long), then drop the connection without an answer
    "reset"    forward, send the headers and half the body, then RST
    "short"    forward, drop the last `cut` bytes of the body and shrink Content-Length to match
    "flip"     forward, flip one bit in the middle of the body (corrupt bytes, right length)
    "range"    forward, shift the Content-Range header by `shift` bytes (a wrong range answer)
- `clear()`: drop every rule.
- `requests`: every request seen (method, path, Range header, status answered, action applied).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from tests.httpproxy import QuietServer, forward, reset_connection, send_forwarded, send_simple

ACTIONS = ("status", "delay", "hang", "reset", "short", "flip", "range")


@dataclass
class Rule:
    action: str
    path: str = "/blobs/"
    method: str = "GET"
    times: int = 1 << 30
    status: int = 500
    seconds: float = 0.0
    cut: int = 7
    shift: int = 1

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str
    status: int
    action: str
    user_agent: str


class FaultProxy:
    """See the module docstring. `upstream` ("HOST:PORT") may be set after construction."""

    def __init__(self, upstream: str = "") -> None:
        self.upstream = upstream
        self.requests: list[Seen] = []
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._httpd: QuietServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self.port = 0
        self.start()

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (again, on the same port once one was chosen)."""
        if self._httpd is not None:
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                self._httpd = QuietServer(("127.0.0.1", self.port), self._handler())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name=f"fault-proxy-{self.port}")
        self._thread.start()

    def stop(self) -> None:
        """Stop listening: new connections are refused (requests in progress finish)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
        # Kept-alive client connections would go on being served: cut them too.
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults -----------------------------------------------------------------------------

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def seen(self, path_part: str = "/blobs/", method: str = "GET") -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.method == method and path_part in r.path]

    def _take(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.times > 0 and rule.method == method and rule.path in path:
                    rule.times -= 1
                    return rule
        return None

    # -- serving ----------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._conns.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._conns.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def do_GET(self) -> None:
                if proxy._httpd is None:
                    self.close_connection = True
                    return reset_connection(self)
                proxy._handle(self)

            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        return Handler

    def _record(self, h: BaseHTTPRequestHandler, status: int, action: str) -> None:
        with self._lock:
            self.requests.append(Seen(h.command, h.path, h.headers.get("Range", ""), status, action,
                                      h.headers.get("User-Agent", "")))

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        rule = self._take(h.command, urlsplit(h.path).path)
        action = rule.action if rule else ""
        if rule is not None and rule.action == "status":
            self._record(h, rule.status, action)
            return send_simple(h, rule.status, b'{"errors":[{"code":"INJECTED","message":"fault proxy"}]}',
                               {"Content-Type": "application/json"})
        if rule is not None and rule.action == "hang":
            time.sleep(rule.seconds)
            self._record(h, 0, action)
            return reset_connection(h)
        if rule is not None and rule.action == "delay":
            time.sleep(rule.seconds)
        try:
            status, headers, data = forward(self.upstream, h, body)
        except OSError:
            self._record(h, 502, action)
            return send_simple(h, 502, b"upstream unreachable")
        self._record(h, status, action)
        if action == "flip" and data:
            i = len(data) // 2
            data = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
        shift, cut = (rule.shift, rule.cut) if rule is not None else (0, 0)
        send_forwarded(h, status, headers, data, range_shift=shift if action == "range" else 0,
                       cut=cut if action == "short" else 0, reset_mid_body=action == "reset")
