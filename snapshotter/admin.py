"""The daemon's admin endpoint: HTTP/1.0 on a unix socket next to the gRPC one (ADDRESS.admin,
mode 0600, so only root, or whoever runs the daemon, can ask).

    GET /status   200, application/json: the status document (snapshotter/status.py)
    anything else 404

One thread per connection; a request that fails answers 500 with the error's text and the
server keeps serving. `stop()` closes the socket and removes the socket file.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class AdminServer:
    """Serves `status()` as JSON on `path` until `stop()`."""

    def __init__(self, path: Path, status: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._status = status
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        status = self._status

        class Handler(BaseHTTPRequestHandler):
            server_version = "snapshotter-admin"

            def log_message(self, format: str, *args: Any) -> None:
                return None  # the daemon logs events, not HTTP access lines

            def address_string(self) -> str:
                return "unix"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?", 1)[0] != "/status":
                    self._answer(404, {"error": f"no such endpoint {self.path!r}; try /status"})
                    return
                try:
                    doc = status()
                except Exception as exc:
                    log.warning("event=admin_status_failed error=%r", str(exc))
                    self._answer(500, {"error": str(exc)})
                    return
                self._answer(200, doc)

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc, indent=1, sort_keys=False).encode() + b"\n"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        try:
            if self.path.is_socket():
                self.path.unlink()  # the gRPC socket's checks already proved no live daemon owns it
        except FileNotFoundError:
            pass
        old_umask = os.umask(0o177)
        try:
            self._server = _Server(str(self.path), Handler)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="admin", daemon=True)
        self._thread.start()
        log.info("event=admin_serving path=%s", self.path)

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self.path.is_socket():
                self.path.unlink()
        except FileNotFoundError:
            pass
