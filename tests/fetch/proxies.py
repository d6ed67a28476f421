"""Small threaded HTTP servers that tests put in front of the real registry.

- `RegistryProxy`: forwards to an upstream registry, optionally
  * demanding Bearer tokens that its own `/token` endpoint issues (GET with optional Basic
    credentials, or POST grant_type=refresh_token), with expiry and `revoke_tokens()`;
  * redirecting blob GETs (307) to a `BlobServer` on another port;
  * injecting faults (`Fault`) into matching requests: a status, a connection reset mid-body,
    a short body, a wrong Content-Range, a delay.
- `BlobServer`: serves in-memory blobs with single-Range support, records request headers.

Every server records requests (`requests`) so tests can assert what was (not) sent.
Stop with `stop()`; use as context managers.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.httpproxy import QuietServer, forward, send_forwarded, send_simple


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    status: int = 0


@dataclass
class Fault:
    """Applied to the next `times` requests whose method matches and whose path contains `path`.

    action: "status" (answer `status` without forwarding), "reset" (forward, send headers and
    half the body, then RST), "short" (forward, drop `cut` bytes from the end and shrink
    Content-Length to match), "bad_content_range" (forward, shift Content-Range by `shift`),
    "delay" (sleep `seconds`, then forward normally), "ignore_range" (forward without the Range
    header: a 200 with the whole blob, as from storage that ignores ranges).
    """

    action: str
    path: str = "/blobs/"
    method: str = "GET"
    times: int = 1
    status: int = 500
    cut: int = 7
    shift: int = 1
    seconds: float = 0.0


class _BaseServer:
    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        handler = self._make_handler()
        self._httpd = QuietServer(("127.0.0.1", 0), handler)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self, handler: BaseHTTPRequestHandler) -> Recorded:
        names = {k.lower() for k in handler.headers.keys()}
        rec = Recorded(handler.command, handler.path,
                       {k: ", ".join(handler.headers.get_all(k) or []) for k in names})
        with self._lock:
            self.requests.append(rec)
        return rec

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        raise NotImplementedError

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.handle(self)

            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        return Handler


class RegistryProxy(_BaseServer):
    def __init__(self, upstream: str, *, bearer: bool = False, token_lifetime: int = 300,
                 token_credentials: tuple[str, str] | None = None, refresh_token: str | None = None,
                 redirect_blobs_to: str | None = None) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.bearer = bearer
        self.token_lifetime = token_lifetime
        self.token_credentials = token_credentials
        self.refresh_token = refresh_token
        self.redirect_blobs_to = redirect_blobs_to
        self.faults: list[Fault] = []
        self.tokens: dict[str, float] = {}
        self.tokens_issued = 0
        self.inflight = 0
        self.max_inflight = 0
        self.token_requests: list[dict[str, list[str]]] = []
        super().__init__()

    def add_fault(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def revoke_tokens(self) -> None:
        with self._lock:
            self.tokens.clear()

    def blob_requests(self, method: str = "GET") -> list[Recorded]:
        return [r for r in self.requests if r.method == method and "/blobs/" in r.path]

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times > 0 and f.method == method and f.path in path:
                    f.times -= 1
                    return f
        return None

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        rec = self.record(h)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        path = urlsplit(h.path).path
        if path == "/token":
            return self._token(h, rec, body)
        if self.bearer and path.startswith("/v2/") and not self._authorized(h):
            m = re.match(r"^/v2/(.+)/(?:manifests|blobs|tags)/", path)
            scope = f',scope="repository:{m.group(1)}:pull"' if m else ""
            rec.status = 401
            return send_simple(h, 401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
                "WWW-Authenticate": f'Bearer realm="{self.url}/token",service="test-proxy"{scope}',
                "Content-Type": "application/json"})
        fault = self._take_fault(h.command, h.path)
        if fault is not None and fault.action == "status":
            rec.status = fault.status
            return send_simple(h, fault.status, b'{"errors":[{"code":"INJECTED"}]}',
                               {"Content-Type": "application/json"})
        if fault is not None and fault.action == "delay":
            with self._lock:
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
            time.sleep(fault.seconds)
            with self._lock:
                self.inflight -= 1
        m = re.match(r"^/v2/(.+)/blobs/(sha256:[0-9a-f]{64})$", path)
        if self.redirect_blobs_to and m and h.command == "GET":
            rec.status = 307
            return send_simple(h, 307, b"", {
                "Location": f"{self.redirect_blobs_to}/storage/{m.group(2)}?sig={secrets.token_hex(4)}"})
        if fault is not None and fault.action == "ignore_range":
            del h.headers["Range"]
        status, headers, rbody = self._forward(h, body)
        rec.status = status
        action, shift, cut = (fault.action, fault.shift, fault.cut) if fault is not None else ("", 0, 0)
        send_forwarded(h, status, headers, rbody, range_shift=shift if action == "bad_content_range" else 0,
                       cut=cut if action == "short" else 0, reset_mid_body=action == "reset")

    def _forward(self, h: BaseHTTPRequestHandler, body: bytes) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return forward(self.upstream, h, body, drop=("authorization",))  # our tokens are not upstream's
        finally:
            with self._lock:
                self.inflight -= 1

    def _authorized(self, h: BaseHTTPRequestHandler) -> bool:
        auth = h.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return False
        with self._lock:
            expiry = self.tokens.get(auth[len("Bearer "):])
        return expiry is not None and time.monotonic() < expiry

    def _token(self, h: BaseHTTPRequestHandler, rec: Recorded, body: bytes) -> None:
        query = parse_qs(urlsplit(h.path).query)
        if h.command == "POST":
            form = parse_qs(body.decode())
            ok = (form.get("grant_type") == ["refresh_token"] and self.refresh_token is not None
                  and form.get("refresh_token") == [self.refresh_token])
            query.update(form)
        elif self.token_credentials is not None:
            user, pw = self.token_credentials
            expected = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
            ok = h.headers.get("Authorization") == expected
        else:
            ok = self.refresh_token is None
        with self._lock:
            self.token_requests.append(query)
        if not ok:
            rec.status = 401
            return send_simple(h, 401, b'{"details":"bad credentials"}')
        token = secrets.token_hex(16)
        with self._lock:
            self.tokens[token] = time.monotonic() + self.token_lifetime
            self.tokens_issued += 1
        rec.status = 200
        body_out = json.dumps({"token": token, "expires_in": self.token_lifetime}).encode()
        send_simple(h, 200, body_out, {"Content-Type": "application/json"})


class BlobServer(_BaseServer):
    """Serves `blobs[digest]` at /storage/DIGEST, with single-Range support."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = dict(blobs)
        super().__init__()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        rec = self.record(h)
        m = re.match(r"^/storage/(sha256:[0-9a-f]{64})$", urlsplit(h.path).path)
        data = self.blobs.get(m.group(1)) if m else None
        if data is None:
            rec.status = 404
            return send_simple(h, 404)
        rng = re.match(r"^bytes=(\d+)-(\d+)$", h.headers.get("Range", ""))
        if rng:
            a, b = int(rng.group(1)), min(int(rng.group(2)), len(data) - 1)
            rec.status = 206
            return send_simple(h, 206, data[a:b + 1], {"Content-Range": f"bytes {a}-{b}/{len(data)}"})
        rec.status = 200
        send_simple(h, 200, data)

