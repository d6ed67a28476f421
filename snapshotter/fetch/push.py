"""Pushing to a registry: blobs and manifests (the OCI distribution spec's push flow).

`RegistryPusher(client)` rides on a `RegistryClient`: same hosts.toml hosts, TLS settings,
plain-HTTP fallback for loopback registries, credentials and bearer-token cache; it asks for
the scope `repository:REPO:pull,push`.

Contracts:
- Hosts: those of the registry with the "push" capability (mirrors normally lack it, so this
  is the origin); none -> RegistryError.
- `push_blob`: HEAD first and skip a blob the repository already has; else POST
  `/v2/REPO/blobs/uploads/` (202 + Location) then one monolithic PUT `LOCATION?digest=D` whose
  body is streamed from the file in 1 MiB pieces (memory stays bounded). Expects 201.
- `push_manifest`: PUT `/v2/REPO/manifests/TAG_OR_DIGEST` with the manifest's media type as
  Content-Type; the registry's Docker-Content-Digest, when given, must equal sha256(content).
- Retries as the client's: 5xx, 408, 429, connection errors, timeouts (`config.retries`,
  exponential backoff), the whole POST+PUT sequence again. A 401 re-authenticates once.
  Every failure leaves as `RegistryError` naming registry, repository, blob/manifest and the
  registry's own error text.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urljoin

import httpx
import trio

from snapshotter.fetch.auth import AuthError
from snapshotter.fetch.client import RegistryClient, RegistryError, _exc_text
from snapshotter.fetch.hosts import PUSH, RegistryHost, split_host_port
from snapshotter.fetch.reference import Reference, parse_reference

T = TypeVar("T")
_PIECE = 1 << 20
_MAX_ERROR_TEXT = 400


class _Failed(Exception):
    def __init__(self, reason: str, *, retryable: bool, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.status = status


def _error_text(resp: httpx.Response) -> str:
    try:
        doc = resp.json()
        errs = doc.get("errors") if isinstance(doc, dict) else None
        if isinstance(errs, list) and errs and isinstance(errs[0], dict):
            return f"{errs[0].get('code', '')}: {errs[0].get('message', '')}".strip(": ")
    except ValueError:
        pass
    return resp.text[:_MAX_ERROR_TEXT].strip()


class RegistryPusher:
    """Push blobs and manifests through `client`'s hosts and credentials."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client

    # ---- public API -------------------------------------------------------------------------

    async def blob_exists(self, repo: Reference | str, digest: str) -> bool:
        r = _ref(repo)

        async def head(host: RegistryHost) -> bool:
            resp = await self._send(host, r, "HEAD", self._url(host, r, f"blobs/{digest}"), {})
            if resp.status_code == 200:
                return True
            if resp.status_code == 404:
                return False
            raise self._status_error(resp)

        return await self._retrying(r, f"blob {digest}", head)

    async def push_blob(self, repo: Reference | str, digest: str, size: int, source: Path | bytes,
                        progress: Callable[[int], None] | None = None) -> bool:
        """Upload blob `digest` (`size` bytes from a file or memory) unless the repository has it.

        Returns True when it was uploaded, False when it was already there.
        """
        r = _ref(repo)
        if await self.blob_exists(r, digest):
            if progress is not None:
                progress(size)
            return False

        async def upload(host: RegistryHost) -> bool:
            resp = await self._send(host, r, "POST", self._url(host, r, "blobs/uploads/"), {})
            if resp.status_code != 202 or "Location" not in resp.headers:
                raise self._status_error(resp, "starting the upload")
            location = httpx.URL(urljoin(str(resp.url), resp.headers["Location"]))
            url = str(location.copy_merge_params({"digest": digest}))
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            resp = await self._send(host, r, "PUT", url, headers, body=lambda: _body(source, progress),
                                    timed=False)
            if resp.status_code != 201:
                raise self._status_error(resp, "finishing the upload")
            return True

        return await self._retrying(r, f"blob {digest}", upload)

    async def push_manifest(self, repo: Reference | str, content: bytes, media_type: str,
                            reference: str) -> None:
        """PUT `content` as manifest `reference` (a tag or the content's digest)."""
        r = _ref(repo)
        digest = "sha256:" + hashlib.sha256(content).hexdigest()

        async def put(host: RegistryHost) -> None:
            resp = await self._send(host, r, "PUT", self._url(host, r, f"manifests/{reference}"),
                                    {"Content-Type": media_type}, body=content)
            if resp.status_code not in (200, 201):
                raise self._status_error(resp)
            got = resp.headers.get("Docker-Content-Digest")
            if got and got != digest:
                raise _Failed(f"registry stored the manifest as {got}, expected {digest}", retryable=False)

        await self._retrying(r, f"manifest {reference}", put)

    # ---- engine -----------------------------------------------------------------------------

    @staticmethod
    def _status_error(resp: httpx.Response, doing: str = "") -> _Failed:
        code = resp.status_code
        text = _error_text(resp)
        what = f"{doing}: " if doing else ""
        return _Failed(f"{what}status {code}{f' ({text})' if text else ''}",
                       retryable=code >= 500 or code in (408, 429), status=code)

    def _url(self, host: RegistryHost, r: Reference, tail: str) -> str:
        scheme = "http" if host.http_fallback and host.host in self.client._plain_http else host.scheme
        return f"{scheme}://{host.host}{host.path}/{r.repository}/{tail}"

    async def _retrying(self, r: Reference, what: str, fn: Callable[[RegistryHost], Awaitable[T]]) -> T:
        cfg = self.client.config
        hosts = [h for h in self.client.hosts(r.registry) if PUSH in h.capabilities]
        if not hosts:
            raise RegistryError(f"registry {r.registry}, repository {r.repository}, {what}: "
                                "no host has the 'push' capability (hosts.toml)")
        last: _Failed | None = None
        for attempt in range(cfg.retries + 1):
            if attempt:
                delay = min(cfg.backoff_max, cfg.backoff_initial * 2 ** (attempt - 1))
                await trio.sleep(delay * (0.5 + random.random() / 2))
            retryable = False
            for host in hosts:
                try:
                    return await fn(host)
                except _Failed as e:
                    last, retryable = e, retryable or e.retryable
                except AuthError as e:
                    last = _Failed(f"authentication failed: {e}", retryable=e.retryable)
                    retryable = retryable or e.retryable
                except httpx.TimeoutException as e:
                    last, retryable = _Failed(f"timeout: {_exc_text(e)}", retryable=True), True
                except httpx.TransportError as e:
                    last, retryable = _Failed(f"connection failed: {_exc_text(e)}", retryable=True), True
                except trio.TooSlowError:
                    last = _Failed(f"timed out after {cfg.request_timeout}s", retryable=True)
                    retryable = True
            if not retryable:
                break
        assert last is not None
        hint = ""
        if last.status in (401, 403):
            hint = "; check the credentials in your docker config.json have push access"
        raise RegistryError(f"registry {r.registry}, repository {r.repository}, pushing {what}: {last.reason}{hint}",
                            status=last.status)

    async def _send(self, host: RegistryHost, r: Reference, method: str, url: str, headers: dict[str, str],
                    *, body: Callable[[], AsyncIterator[bytes]] | bytes | None = None,
                    timed: bool = True) -> httpx.Response:
        """One request with auth (one re-auth on 401) and the loopback plain-HTTP fallback."""
        client = self.client._client(host)
        scope = f"repository:{r.repository}:pull,push"
        authorizer = self.client.authorizer
        reauthed = False
        while True:
            same_origin = _same_host(url, host)
            req_headers = list(headers.items()) + (list(host.header) if same_origin else [])
            auth = await authorizer.authorization(host.host, scope, client) if same_origin else None
            if auth:
                req_headers.append(("Authorization", auth))
            content = body() if callable(body) else body
            request = client.build_request(method, url, headers=req_headers, content=content)
            try:
                if timed:
                    with trio.fail_after(self.client.config.request_timeout):
                        resp = await client.send(request)
                else:
                    resp = await client.send(request)
            except httpx.ConnectError:
                if host.http_fallback and host.host not in self.client._plain_http and url.startswith("https:"):
                    self.client._plain_http.add(host.host)
                    url = "http:" + url[len("https:"):]
                    continue
                raise
            if resp.status_code == 401 and not reauthed:
                reauthed = True
                if authorizer.on_unauthorized(host.host, resp.headers.get_list("WWW-Authenticate"), auth):
                    continue
            if resp.status_code == 401:
                raise _Failed("unauthorized (401)", retryable=False, status=401)
            return resp


def _same_host(url: str, host: RegistryHost) -> bool:
    """Whether `url` points at `host` itself (credentials and hosts.toml headers go nowhere else)."""
    u = httpx.URL(url)
    name, port = split_host_port(host.host)
    default = 443 if u.scheme == "https" else 80
    return u.host == name.strip("[]") and (u.port or default) == (port or default)


def _ref(repo: Reference | str) -> Reference:
    return parse_reference(repo) if isinstance(repo, str) else repo


async def _body(source: Path | bytes, progress: Callable[[int], None] | None) -> AsyncIterator[bytes]:
    if isinstance(source, bytes):
        yield source
        if progress is not None:
            progress(len(source))
        return
    with open(source, "rb") as f:
        while piece := f.read(_PIECE):
            yield piece
            if progress is not None:
                progress(len(piece))
