"""The registry client: manifests, blob sizes and byte ranges over HTTP(S), with mirrors.

Contracts:
- Every failure leaves as `RegistryError` (a `snapshotter.errors.FetchError`) whose message
  names the registry, the repository, the digest (or tag) and, for reads, the byte range.
  httpx exceptions never escape.
- Retried (with exponential backoff, `FetchConfig.retries` times): 5xx, 408, 429, connection
  and protocol errors, timeouts, short bodies and Content-Range answers that do not match
  the request. Not retried: 404 and other 4xx; a 401 is retried once after re-authenticating.
  Each retry logs a warning with the same context as the error.
- Hosts come from hosts.toml (`hosts.load_hosts`): mirrors in order, then the origin. A round
  tries each host that has the needed capability; a mirror that fails at the connection level
  is skipped for `mirror_cooldown` seconds. Which host served is logged at INFO when it changes.
- Redirects (to blob storage) are followed by hand; Authorization and hosts.toml headers are
  only ever sent to the configured host, never to another scheme/host/port. A 401/403 from a
  redirect target (an expired pre-signed URL) is retried through the registry.
- Range answers: 206 with a Content-Range that covers the request (sliced), 206
  multipart/byteranges for multi-range requests, or 200 with the whole blob (a server that
  ignores Range, e.g. a pull-through cache's first fetch: streamed, sliced, rest dropped).
  A server that does not answer multi-range requests with multipart is remembered and gets
  single-range requests from then on.
- Concurrency: at most `max_parallel_per_registry` requests per contacted host, at most
  `max_inflight_bytes` of range bytes requested at once.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import os
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import urljoin, urlsplit

import httpcore  # noqa: F401  # httpx imports it with the first client; load it with ours, not in a pull
import httpx
import trio

from snapshotter.errors import FetchError
from snapshotter.fetch.auth import AuthError, Authorizer, CredentialStore
from snapshotter.fetch.config import FetchConfig
from snapshotter.fetch.hosts import PULL, RESOLVE, RegistryHost, load_hosts
from snapshotter.fetch.ranges import (
    ByteRange,
    RangeError,
    Span,
    group_spans,
    multipart_boundary,
    parse_content_range,
    parse_multipart_byteranges,
    plan_spans,
    range_header,
)
from snapshotter.fetch.reference import Reference, parse_reference

log = logging.getLogger("snapshotter.fetch")

T = TypeVar("T")

MANIFEST_MEDIA_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
MAX_REDIRECTS = 5
_MULTIPART_OVERHEAD = 256  # bytes of part headers we allow per part


class BlobPiece(Protocol):
    """What `read_chunks` needs of a chunk (formats.index.Chunk fits; fetch does not import it)."""

    @property
    def blob_offset(self) -> int: ...

    @property
    def blob_size(self) -> int: ...


class BodySink(Protocol):
    """Where `stream_range` puts a range's bytes (structurally, the reader's RangeSink)."""

    async def restart(self) -> None: ...

    async def write(self, data: bytes | bytearray | memoryview) -> None: ...


class _BufferSink:
    """A BodySink collecting a range of known length into one buffer allocated up front (a
    4 MiB chunk costs 4 MiB, not a growing buffer plus its copy)."""

    def __init__(self, length: int) -> None:
        self._buf = bytearray(length)
        self._view = memoryview(self._buf)
        self._pos = 0

    async def restart(self) -> None:
        self._pos = 0

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        end = self._pos + len(data)
        self._view[self._pos:end] = data
        self._pos = end

    def result(self) -> bytearray:
        self._view.release()
        return self._buf


class RegistryError(FetchError):
    """A registry request failed. `status` is the last HTTP status seen, if any."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _AttemptError(Exception):
    """One attempt failed; `retryable` says whether another attempt may help."""

    def __init__(self, reason: str, *, retryable: bool, status: int | None = None,
                 connection: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.status = status
        self.connection = connection


class _NoMultiRange(Exception):
    """The server answered a multi-range request without multipart; use single ranges."""


@dataclass(frozen=True)
class Descriptor:
    """An OCI descriptor as far as the data path needs it."""

    media_type: str
    digest: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """A manifest or index as the registry served it; `content` hashes to `descriptor.digest`."""

    descriptor: Descriptor
    content: bytes

    def json(self) -> Any:
        """The parsed JSON; raises FetchError (not ValueError) for content that is not JSON."""
        try:
            return json.loads(self.content)
        except ValueError as e:
            raise FetchError(f"manifest {self.descriptor.digest} is not JSON: {e}") from e


# Body bytes received on behalf of one caller of a shared client (`counting_bytes`): the
# context is per trio task, so callers running at the same time are counted apart.
_TASK_TALLY: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("fetch_tally", default=None)


@contextmanager
def counting_bytes() -> Iterator[list[int]]:
    """Within the block, body bytes this task's requests receive (from any RegistryClient) are
    added to the yielded one-element list."""
    tally = [0]
    token = _TASK_TALLY.set(tally)
    try:
        yield tally
    finally:
        _TASK_TALLY.reset(token)


@dataclass
class FetchStatistics:
    """Counters since the client was made (a snapshot is `dataclasses.replace(stats)`)."""

    requests: int = 0
    range_requests: int = 0
    multi_range_requests: int = 0
    retries: int = 0
    bytes_received: int = 0
    # Body bytes by the host (HOST[:PORT]) that sent them: a mirror or the origin.
    bytes_by_host: dict[str, int] = field(default_factory=dict)

    def add(self, other: FetchStatistics) -> None:
        """Count another client's statistics as this one's (the same process's early prefetch)."""
        self.requests += other.requests
        self.range_requests += other.range_requests
        self.multi_range_requests += other.multi_range_requests
        self.retries += other.retries
        self.bytes_received += other.bytes_received
        for host, n in other.bytes_by_host.items():
            self.bytes_by_host[host] = self.bytes_by_host.get(host, 0) + n

    def note_bytes(self, resp: httpx.Response, n: int) -> None:
        self.bytes_received += n
        tally = _TASK_TALLY.get()
        if tally is not None:
            tally[0] += n
        try:
            url = resp.request.url
            host = f"{url.host}:{url.port}" if url.port else url.host  # never the userinfo part
        except RuntimeError:  # a response built without a request (tests)
            host = ""
        self.bytes_by_host[host] = self.bytes_by_host.get(host, 0) + n


@dataclass(frozen=True)
class _Ctx:
    """What an error message names."""

    ref: Reference
    what: str  # "manifest" / "blob"
    obj: str  # digest or tag
    byte_range: str = ""

    def describe(self, host: RegistryHost | None = None) -> str:
        reg = self.ref.registry
        if host is not None and host.host != reg:
            reg = f"{host.host} ({'mirror' if host.is_mirror else 'server'} for {self.ref.registry})"
        out = f"registry {reg}, repository {self.ref.repository}, {self.what} {self.obj}"
        if self.byte_range:
            out += f", range {self.byte_range}"
        return out


class _ByteBudget:
    """Bounds bytes in flight; a request bigger than the cap runs when nothing else does."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0
        self._changed = trio.Event()

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        while self.used and self.used + n > self.cap:
            await self._changed.wait()
        self.used += n
        try:
            yield
        finally:
            self.used -= n
            self._changed.set()
            self._changed = trio.Event()


def _origin(url: str | httpx.URL) -> tuple[str, str, int | None]:
    u = httpx.URL(str(url))
    port = u.port or (443 if u.scheme == "https" else 80)
    return (u.scheme, u.host, port)


def _exc_text(exc: BaseException) -> str:
    """A readable cause for a transport error: httpx often wraps the real one (an SSL
    verification failure, ECONNREFUSED) in exceptions with empty messages."""
    seen: list[str] = []
    x: BaseException | None = exc
    for _ in range(6):
        if x is None:
            break
        text = str(x).strip()
        if text and not any(text in s for s in seen):
            seen.append(text)
        if isinstance(x, BaseExceptionGroup) and x.exceptions:
            x = x.exceptions[0]
        else:
            x = x.__cause__ or x.__context__
    return f"{type(exc).__name__}: {'; '.join(seen) or 'no detail'}"


def _as_ref(ref: Reference | str) -> Reference:
    return parse_reference(ref) if isinstance(ref, str) else ref


def _digest_of(data: bytes, algo: str) -> str | None:
    if algo not in ("sha256", "sha384", "sha512"):
        return None
    return f"{algo}:{hashlib.new(algo, data).hexdigest()}"


def _file_key(path: object) -> tuple[str, int]:
    """A file as a cache key: its path and modification time (a replaced CA file is reloaded)."""
    try:
        return str(path), os.stat(str(path)).st_mtime_ns
    except OSError:
        return str(path), -1  # loading it raises the error the user should see


@functools.lru_cache(maxsize=32)
def _tls_context(skip_verify: bool, cas: tuple[tuple[str, int], ...],
                 client_certs: tuple[tuple[tuple[str, int], tuple[str, int] | None], ...]) -> ssl.SSLContext:
    """One TLS context per distinct setting, shared by every client of the process: loading the
    system CA store takes ~20 ms, and the daemon makes a client per layer it resolves.

    A context that verifies nothing (`skip_verify`: hosts.toml's, and every loopback registry's
    by default) does not load the system CA store: it would go unused, and it costs ~20 ms on
    the first request to such a host (a cold pull's first Prepare) and ~2 MiB in each process."""
    if skip_verify:
        # create_default_context() without its load_default_certs(): the same protocol floor
        # and options, no verification.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context()
    for ca, _mtime in cas:
        ctx.load_verify_locations(cafile=ca)
    for (cert, _m), key in client_certs:
        ctx.load_cert_chain(cert, key[0] if key else None)
    return ctx


def warm_up() -> None:
    """Build the default TLS context now (a spare mount process does this while it waits)."""
    _tls_context(False, (), ())


class RegistryClient:
    """Async (trio) OCI distribution client. Use as `async with RegistryClient(cfg) as c:`."""

    def __init__(self, config: FetchConfig | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config or FetchConfig()
        self._transport = transport
        self._clients: dict[tuple[object, ...], httpx.AsyncClient] = {}
        self._hosts: dict[str, tuple[RegistryHost, ...]] = {}
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        self._budget = _ByteBudget(self.config.max_inflight_bytes)
        self._plain_http: set[str] = set()
        self._tls_hosts: set[str] = set()  # fallback hosts that answered TLS: no more plain races
        self._no_multirange: set[str] = set()
        self._mirror_down_until: dict[str, float] = {}
        self._served_by: dict[tuple[str, str], str] = {}
        self.authorizer = Authorizer(CredentialStore(self.config.docker_config),
                                     expiry_margin=self.config.token_expiry_margin,
                                     user_agent=self.config.user_agent)
        self.stats = FetchStatistics()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            with trio.CancelScope(shield=True):
                await c.aclose()

    # ---- public API -------------------------------------------------------------------------

    def hosts(self, registry: str) -> tuple[RegistryHost, ...]:
        """Endpoints for `registry` (hosts.toml read once per client; ConfigError if broken)."""
        if registry not in self._hosts:
            self._hosts[registry] = load_hosts(self.config.hosts_config_path, registry)
        return self._hosts[registry]

    def forget_hosts(self) -> None:
        """Read hosts.toml again on the next request (a long-lived client calls this per job)."""
        self._hosts.clear()

    def plain_http_hosts(self) -> frozenset[str]:
        """Hosts this client found answering plain HTTP only (a TLS attempt failed to connect
        and the host allows falling back: loopback registries, hosts.toml's `http://` origin)."""
        return frozenset(self._plain_http)

    def assume_plain_http(self, hosts: Iterable[str]) -> None:
        """Talk plain HTTP to these hosts at once where falling back is allowed: another process
        (the daemon, for a mount process) already found they answer plain HTTP only, so the
        first request need not try TLS first. Hosts that must use TLS are not affected."""
        self._plain_http.update(hosts)

    def auth_handoff(self, repositories: Iterable[str]) -> dict[str, Any]:
        """What this client learned of authenticating with its registries, for another process
        that will pull from these repositories (`adopt_auth`): the hosts' challenges and their
        pull tokens (`Authorizer.handoff`; secrets: pass it over a pipe). Any thread."""
        return self.authorizer.handoff(f"repository:{repo}:pull" for repo in repositories)

    def adopt_auth(self, handoff: Mapping[str, Any]) -> int:
        """Authorize requests with what another process's `auth_handoff` gave; the number of
        tokens taken. Call it from this client's trio run."""
        return self.authorizer.adopt(handoff)

    def use_plain_http(self, registry: str) -> None:
        """Talk plain HTTP (no TLS attempt) to every host of `registry` (a CLI's --plain-http)."""
        self._hosts[registry] = tuple(dataclasses.replace(h, scheme="http", http_fallback=False)
                                      for h in self.hosts(registry))

    async def resolve(self, ref: Reference | str) -> Descriptor:
        """Descriptor of the manifest or index `ref` names (HEAD; GET when HEAD says too little)."""
        r = _as_ref(ref)
        ctx = _Ctx(r, "manifest", r.object)

        async def on_head(resp: httpx.Response, host: RegistryHost) -> Descriptor | None:
            self._check_status(resp, ctx)
            digest = resp.headers.get("Docker-Content-Digest") or r.digest
            length = resp.headers.get("Content-Length")
            if not digest or length is None:
                return None
            if r.digest and digest != r.digest:
                raise _AttemptError(f"registry says digest {digest}, reference says {r.digest}",
                                    retryable=False)
            mt = resp.headers.get("Content-Type", "").split(";")[0].strip()
            return Descriptor(mt, digest, int(length))

        desc = await self._request(ctx, "HEAD", RESOLVE, {"Accept": self._accept()}, on_head)
        if desc is not None:
            return desc
        return (await self.fetch_manifest(r)).descriptor

    async def fetch_manifest(self, ref: Reference | str, descriptor: Descriptor | None = None) -> Manifest:
        """GET the manifest (by `descriptor.digest`, else the reference's digest, else its tag).

        Content must hash to the digest when one is known, and stay within max_manifest_bytes.
        """
        r = _as_ref(ref)
        want = descriptor.digest if descriptor else r.digest
        if want and want != r.digest:
            r = r.with_digest(want)
        ctx = _Ctx(r, "manifest", r.object)
        cap = self.config.max_manifest_bytes

        async def on_get(resp: httpx.Response, host: RegistryHost) -> Manifest:
            self._check_status(resp, ctx)
            data = await self._read_body(resp, cap)
            # By tag, the registry's Docker-Content-Digest is the only check there is.
            expected = want or resp.headers.get("Docker-Content-Digest")
            algo = (expected or "sha256:").split(":")[0]
            actual = _digest_of(data, algo) or _digest_of(data, "sha256")
            assert actual is not None
            if expected and actual != expected:
                raise _AttemptError(f"manifest content hashes to {actual}, expected {expected}", retryable=True)
            mt = resp.headers.get("Content-Type", "").split(";")[0].strip()
            if descriptor and descriptor.media_type:
                mt = mt or descriptor.media_type
            return Manifest(Descriptor(mt, want or actual, len(data)), data)

        cap_kind = PULL if r.digest else RESOLVE
        return await self._request(ctx, "GET", cap_kind, {"Accept": self._accept()}, on_get)

    async def blob_size(self, repo: Reference | str, digest: str) -> int:
        """Size of blob `digest` in `repo` (HEAD Content-Length)."""
        r = _as_ref(repo)
        ctx = _Ctx(r, "blob", digest)

        async def on_head(resp: httpx.Response, host: RegistryHost) -> int:
            self._check_status(resp, ctx)
            length = resp.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise _AttemptError("HEAD answer has no Content-Length", retryable=True)
            return int(length)

        return await self._request(ctx, "HEAD", PULL, {}, on_head)

    async def read_range(self, repo: Reference | str, digest: str, offset: int, length: int) -> bytes | bytearray:
        """Bytes [offset, offset+length) of blob `digest`; exactly `length` bytes or an error
        (a bytearray when that saves copying them)."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range {offset}+{length}")
        if length == 0:
            return b""
        r = _as_ref(repo)
        br = ByteRange(offset, offset + length)
        async with self._budget.hold(length):
            return await self._read_single(r, digest, br)

    async def read_tail(self, repo: Reference | str, digest: str, length: int) -> tuple[bytes, int]:
        """(the last `length` bytes of blob `digest`, or all of it when shorter; the blob's size),
        in one round trip: a suffix range (`Range: bytes=-N`) answered with a Content-Range that
        gives the size. A server that answers it otherwise costs a HEAD and a plain range read."""
        if length <= 0:
            raise ValueError(f"bad tail length {length}")
        r = _as_ref(repo)
        ctx = _Ctx(r, "blob", digest, f"last {length} bytes")

        async def on_get(resp: httpx.Response, host: RegistryHost) -> tuple[bytes, int] | None:
            self.stats.range_requests += 1  # as _read_single counts: every answer to a range GET
            if resp.status_code != 206:
                if resp.status_code in (200, 416):
                    return None  # no suffix ranges here (200: the whole blob; not read)
                self._check_status(resp, ctx)
                raise _AttemptError(f"unexpected status {resp.status_code} for a range request",
                                    retryable=True, status=resp.status_code)
            got, total = self._content_range(resp)
            if total is None or got.end != total or got.length > length:
                return None  # not the suffix asked for; read it the plain way
            return bytes(await self._read_exact(resp, got.length)), total

        async with self._budget.hold(length):
            answer = await self._request(ctx, "GET", PULL, {"Range": f"bytes=-{length}"}, on_get)
        if answer is not None:
            return answer
        log.info("%s: no suffix range answer; asking for the size first", ctx.describe())
        size = await self.blob_size(r, digest)
        n = min(size, length)
        return bytes(await self.read_range(r, digest, size - n, n)), size

    async def read_ranges(self, repo: Reference | str, digest: str,
                          ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Bytes of each (offset, length) in `ranges`, in the given order.

        Nearby ranges are merged (plan_spans), spans are grouped into multi-range requests
        (falling back to single ranges), and groups run in parallel within the limits.
        """
        r = _as_ref(repo)
        cfg = self.config
        spans = plan_spans(ranges, max_bytes=cfg.max_merge_bytes, max_gap=cfg.max_merge_gap)
        groups = group_spans(spans, max_ranges=cfg.max_ranges_per_request, max_bytes=cfg.max_merge_bytes)
        span_data: dict[ByteRange, bytes | bytearray] = {}

        async def run_group(group: list[Span]) -> None:
            nbytes = sum(s.range.length for s in group)
            async with self._budget.hold(nbytes):
                got = await self._read_group(r, digest, [s.range for s in group])
            span_data.update(zip([s.range for s in group], got, strict=True))

        async with trio.open_nursery() as nursery:
            for group in groups:
                nursery.start_soon(run_group, group)
        out: list[bytes] = [b""] * len(ranges)
        for span in spans:
            data = span_data[span.range]
            for i in span.members:
                off, n = ranges[i]
                start = off - span.range.start
                out[i] = data[start:start + n] if isinstance(data, bytes) else bytes(memoryview(data)[start:start + n])
        return out

    async def read_chunks(self, repo: Reference | str, digest: str, chunks: Sequence[BlobPiece]) -> list[bytes]:
        """Compressed bytes of each chunk (its blob_offset/blob_size) of blob `digest`."""
        return await self.read_ranges(repo, digest, [(c.blob_offset, c.blob_size) for c in chunks])

    # ---- ranges -----------------------------------------------------------------------------

    async def _read_group(self, r: Reference, digest: str, brs: list[ByteRange]) -> Sequence[bytes | bytearray]:
        if len(brs) > 1:
            hosts = [h.host for h in self.hosts(r.registry)]
            if not all(h in self._no_multirange for h in hosts):
                try:
                    return await self._read_multi(r, digest, brs)
                except _NoMultiRange:
                    pass
        out: list[bytes | bytearray] = [b""] * len(brs)

        async def one(i: int) -> None:
            out[i] = await self._read_single(r, digest, brs[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(brs)):
                nursery.start_soon(one, i)
        return out

    def _range_answer(self, resp: httpx.Response, br: ByteRange, ctx: _Ctx) -> ByteRange | None:
        """What a single-range GET answered: the Content-Range of a 206 that covers `br`, or None
        for a 200 (the whole blob: a server that ignores Range). Other answers raise."""
        self.stats.range_requests += 1
        if resp.status_code == 200:
            return None
        if resp.status_code == 416:
            cr = resp.headers.get("Content-Range")
            raise _AttemptError(f"range not satisfiable (Content-Range {cr})", retryable=False, status=416)
        self._check_status(resp, ctx)
        if resp.status_code != 206:
            raise _AttemptError(f"unexpected status {resp.status_code} for a range request",
                                retryable=True, status=resp.status_code)
        got, total = self._content_range(resp)
        self._check_covers(got, total, [br])
        return got

    async def _read_single(self, r: Reference, digest: str, br: ByteRange) -> bytes | bytearray:
        sink = _BufferSink(br.length)
        await self._stream_single(r, digest, br, sink)
        return sink.result()

    async def stream_range(self, repo: Reference | str, digest: str, offset: int, length: int,
                           sink: BodySink) -> None:
        """`read_range`, but the bytes go to `sink.write` in pieces as they arrive (nothing is
        held here); a retried request first calls `sink.restart()`. The same errors and retries
        as `read_range`; what the sink raises ends the read and comes out as itself."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range {offset}+{length}")
        if length == 0:
            return
        br = ByteRange(offset, offset + length)
        async with self._budget.hold(length):
            await self._stream_single(_as_ref(repo), digest, br, sink)

    async def _stream_single(self, r: Reference, digest: str, br: ByteRange, sink: BodySink) -> None:
        """One single-range GET of `br` into the sink: a 206 whose Content-Range covers it, or a
        200 with the whole blob (a server that ignores Range), sliced either way."""
        ctx = _Ctx(r, "blob", digest, str(br))
        started = False

        async def on_get(resp: httpx.Response, host: RegistryHost) -> None:
            nonlocal started
            got = self._range_answer(resp, br, ctx)
            if got is None:
                log.info("%s: server ignored Range and sent the whole blob; slicing it", ctx.describe(host))
            if started:
                await sink.restart()
            started = True
            skip = br.start - (0 if got is None else got.start)
            body = None if got is None else got.length  # a 206 body must be exactly its Content-Range
            await self._stream_body(resp, skip, br.length, body, sink)

        await self._request(ctx, "GET", PULL, {"Range": range_header([br])}, on_get)

    async def _stream_body(self, resp: httpx.Response, skip: int, length: int, body: int | None,
                           sink: BodySink) -> None:
        """Body bytes [skip, skip+length) to the sink; `body`: the body's exact length (the rest
        after the wanted bytes is read and dropped), None: any length (reading stops early)."""
        seen = given = 0
        async for piece in resp.aiter_raw():
            self.stats.note_bytes(resp, len(piece))
            lo, seen = seen, seen + len(piece)
            if body is not None and seen > body:
                raise _AttemptError(f"body larger than {body} bytes", retryable=True)
            a, b = max(skip, lo), min(skip + length, seen)
            if a < b:
                await sink.write(piece if (a, b) == (lo, seen) else memoryview(piece)[a - lo:b - lo])
                given += b - a
            if body is None and given == length:
                return
        if given != length or (body is not None and seen != body):
            raise _AttemptError(f"short body: {seen} of {length if body is None else body} bytes", retryable=True)

    async def _read_multi(self, r: Reference, digest: str, brs: list[ByteRange]) -> list[bytes]:
        ctx = _Ctx(r, "blob", digest, ",".join(b.header_spec() for b in brs))
        total_len = sum(b.length for b in brs)

        async def on_get(resp: httpx.Response, host: RegistryHost) -> list[bytes]:
            self.stats.multi_range_requests += 1
            if resp.status_code == 200:
                self._mark_no_multirange(host, "answered 200 (whole blob)")
                raise _NoMultiRange
            if resp.status_code == 416:
                raise _AttemptError("range not satisfiable", retryable=False, status=416)
            self._check_status(resp, ctx)
            if resp.status_code != 206:
                raise _AttemptError(f"unexpected status {resp.status_code}", retryable=True,
                                    status=resp.status_code)
            try:
                boundary = multipart_boundary(resp.headers.get("Content-Type", ""))
            except RangeError as e:
                raise _AttemptError(str(e), retryable=True) from e
            if boundary is None:
                # One Content-Range for everything: a server that coalesced the ranges.
                got, total = self._content_range(resp)
                if not (got.start <= brs[0].start and got.end >= brs[-1].end):
                    self._mark_no_multirange(host, f"answered one range {got} to a multi-range request")
                    raise _NoMultiRange
                self._check_covers(got, total, brs)
                view = memoryview(await self._read_exact(resp, got.length))
                return [bytes(view[b.start - got.start:b.end - got.start]) for b in brs]
            body = await self._read_body(resp, total_len + _MULTIPART_OVERHEAD * (len(brs) + 1) + 1024)
            try:
                parts = parse_multipart_byteranges(body, boundary)
            except RangeError as e:
                raise _AttemptError(f"bad multipart/byteranges body: {e}", retryable=True) from e
            out: list[bytes] = []
            for b in brs:
                part = next(((pr, pd) for pr, pd in parts if pr.start <= b.start and pr.end >= b.end), None)
                if part is None:
                    raise _AttemptError(f"multipart answer lacks {b}", retryable=True)
                out.append(part[1][b.start - part[0].start:b.end - part[0].start])
            return out

        return await self._request(ctx, "GET", PULL, {"Range": range_header(brs)}, on_get)

    def _mark_no_multirange(self, host: RegistryHost, why: str) -> None:
        if host.host not in self._no_multirange:
            log.info("registry %s %s; using single-range requests from now on", host.host, why)
            self._no_multirange.add(host.host)

    @staticmethod
    def _content_range(resp: httpx.Response) -> tuple[ByteRange, int | None]:
        value = resp.headers.get("Content-Range")
        if value is None:
            raise _AttemptError("206 answer without Content-Range", retryable=True)
        try:
            return parse_content_range(value)
        except RangeError as e:
            raise _AttemptError(str(e), retryable=True) from e

    @staticmethod
    def _check_covers(got: ByteRange, total: int | None, want: list[ByteRange]) -> None:
        if total is not None and want[-1].end > total:
            raise _AttemptError(f"range ends past the blob's {total} bytes", retryable=False, status=206)
        if got.start > want[0].start or got.end < want[-1].end:
            raise _AttemptError(f"wrong Content-Range: got {got}, asked {want[0].start}-{want[-1].end - 1}",
                                retryable=True)

    # ---- the request engine -----------------------------------------------------------------

    @staticmethod
    def _accept() -> str:
        return ", ".join((*MANIFEST_MEDIA_TYPES, "*/*"))

    def _check_status(self, resp: httpx.Response, ctx: _Ctx) -> None:
        code = resp.status_code
        if code in (200, 206):
            return
        if code == 404:
            raise _AttemptError("not found (404)", retryable=False, status=code)
        if code >= 500 or code in (408, 429):
            raise _AttemptError(f"server error {code}", retryable=True, status=code)
        raise _AttemptError(f"unexpected status {code}", retryable=False, status=code)

    async def _read_exact(self, resp: httpx.Response, length: int) -> bytearray:
        """Exactly `length` body bytes, into one buffer allocated up front: a 4 MiB chunk costs
        4 MiB, not a growing buffer plus its copy."""
        buf = bytearray(length)
        view = memoryview(buf)
        pos = 0
        async for piece in resp.aiter_raw():
            self.stats.note_bytes(resp, len(piece))
            end = pos + len(piece)
            if end > length:
                raise _AttemptError(f"body larger than {length} bytes", retryable=True)
            view[pos:end] = piece
            pos = end
        if pos != length:
            raise _AttemptError(f"short body: {pos} of {length} bytes", retryable=True)
        return buf

    async def _read_body(self, resp: httpx.Response, limit: int) -> bytes:
        """A body of unknown length, at most `limit` bytes (a bigger one is not retried: the
        next answer would be as big). A body whose length is known: `_read_exact`."""
        buf = bytearray()
        async for piece in resp.aiter_raw():
            self.stats.note_bytes(resp, len(piece))
            buf += piece
            if len(buf) > limit:
                raise _AttemptError(f"body larger than {limit} bytes", retryable=False)
        return bytes(buf)

    def _limiter(self, host: str) -> trio.CapacityLimiter:
        lim = self._limiters.get(host)
        if lim is None:
            lim = self._limiters[host] = trio.CapacityLimiter(self.config.max_parallel_per_registry)
        return lim

    def _client(self, host: RegistryHost | None) -> httpx.AsyncClient:
        key = host.tls_key() if host is not None else ("default",)
        client = self._clients.get(key)
        if client is not None:
            return client
        cfg = self.config
        if host is not None and (host.skip_verify or host.ca or host.client_certs):
            verify = _tls_context(bool(host.skip_verify), tuple(_file_key(ca) for ca in host.ca),
                                  tuple((_file_key(c), _file_key(k) if k else None) for c, k in host.client_certs))
        else:
            verify = _tls_context(False, (), ())
        timeout = httpx.Timeout(connect=cfg.connect_timeout, read=cfg.read_timeout,
                                write=cfg.read_timeout, pool=cfg.request_timeout)
        limits = httpx.Limits(max_connections=None,
                              max_keepalive_connections=cfg.max_parallel_per_registry * 4)
        kwargs: dict[str, Any] = {}
        if self._transport is not None:
            kwargs["transport"] = self._transport
        client = httpx.AsyncClient(verify=verify, timeout=timeout, limits=limits, follow_redirects=False,
                                   headers={"User-Agent": cfg.user_agent, "Accept-Encoding": "identity"},
                                   **kwargs)
        self._clients[key] = client
        return client

    def _host_url(self, host: RegistryHost, ctx: _Ctx) -> str:
        scheme = "http" if host.http_fallback and host.host in self._plain_http else host.scheme
        url = f"{scheme}://{host.host}{host.path}/{ctx.ref.repository}/{ctx.what}s/{ctx.obj}"
        if host.is_mirror:
            url += f"?ns={ctx.ref.registry}"
        return url

    async def _request(self, ctx: _Ctx, method: str, capability: str, headers: dict[str, str],
                       handler: Callable[[httpx.Response, RegistryHost], Awaitable[T]]) -> T:
        cfg = self.config
        hosts = [h for h in self.hosts(ctx.ref.registry) if capability in h.capabilities]
        if not hosts:
            raise RegistryError(f"no host has the {capability!r} capability ({ctx.describe()})")
        last: tuple[RegistryHost, _AttemptError] | None = None
        attempts = cfg.retries + 1
        for attempt in range(attempts):
            if attempt:
                delay = min(cfg.backoff_max, cfg.backoff_initial * 2 ** (attempt - 1))
                await trio.sleep(delay * (0.5 + random.random() / 2))
            now = trio.current_time()
            usable = [h for h in hosts if not h.is_mirror or self._mirror_down_until.get(h.host, 0) <= now]
            usable = usable or hosts
            any_retryable = False
            for host in usable:
                try:
                    result = await self._attempt(host, ctx, method, headers, handler)
                except _AttemptError as e:
                    last = (host, e)
                    any_retryable |= e.retryable
                    if host.is_mirror and e.connection:
                        self._mirror_down_until[host.host] = trio.current_time() + cfg.mirror_cooldown
                    log.warning("%s: %s (attempt %d/%d)", ctx.describe(host), e.reason, attempt + 1, attempts)
                    continue
                self._note_served(ctx, host)
                return result
            if not any_retryable:
                break
            if attempt + 1 < attempts:
                self.stats.retries += 1
        assert last is not None
        host, err = last
        raise RegistryError(f"{ctx.describe(host)}: {err.reason}", status=err.status)

    def _scheme_unknown(self, host: RegistryHost, url: str) -> bool:
        """True for a host that may fall back to plain HTTP and has not yet shown which it speaks."""
        return host.http_fallback and url.startswith("https://") and host.host not in self._plain_http \
            and host.host not in self._tls_hosts

    def _note_plain_http(self, host: RegistryHost) -> None:
        if host.host not in self._plain_http:
            log.info("registry %s: no TLS answer; falling back to plain HTTP", host.host)
            self._plain_http.add(host.host)

    async def _tls_or_plain(self, client: httpx.AsyncClient, request: httpx.Request,
                            host: RegistryHost) -> httpx.Response:
        """The answer to `request` (https://) from a host that may speak plain HTTP only: the
        same request goes out over plain HTTP at once, alongside the TLS attempt, so learning
        which one the host speaks costs no round trip of its own. A plain answer with a 2xx
        status shows that the port speaks plain HTTP (a TLS port answers a plain request with a
        400, or not at all): it is used at once, the TLS attempt dropped, and the host is
        remembered as plain, with no wait for a TLS attempt that a port may never answer (one
        that drops or stalls a ClientHello). Otherwise TLS wins when its handshake succeeds (the plain
        answer is dropped and the host is remembered as speaking TLS); when TLS cannot connect,
        the plain answer is used and the host is remembered as plain (as the TLS-then-plain
        fallback would). Only for requests that carry no credentials (the caller's rule):
        nothing secret goes out unencrypted. Raises what the chosen scheme's request raised
        (httpx errors)."""
        plain_request = client.build_request(request.method, request.url.copy_with(scheme="http"),
                                             headers=request.headers)
        plain: list[httpx.Response | Exception] = []
        plain_done = trio.Event()
        tls_attempt = trio.CancelScope()

        async def send_plain() -> None:
            try:
                plain.append(await client.send(plain_request, stream=True))
            except Exception as exc:  # httpx errors; what to do with them is decided below
                plain.append(exc)
            finally:
                plain_done.set()
            answer = plain[0]
            if isinstance(answer, httpx.Response) and answer.is_success:
                tls_attempt.cancel()

        tls: httpx.Response | None = None
        tls_error: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_plain)
            with tls_attempt:
                try:
                    tls = await client.send(request, stream=True)
                except httpx.ConnectError:
                    await plain_done.wait()
                except BaseException as exc:  # raised after the nursery: inside it, it would be grouped
                    tls_error = exc
            if tls_attempt.cancel_called and isinstance(tls_error, trio.Cancelled):
                tls_error = None  # the plain answer won (were the caller cancelled too, trio says so again)
            nursery.cancel_scope.cancel()
        if tls is not None or tls_error is not None:
            for outcome in plain:
                if isinstance(outcome, httpx.Response):
                    await outcome.aclose()
            if tls_error is not None:
                raise tls_error
            assert tls is not None
            self._tls_hosts.add(host.host)
            return tls
        self._note_plain_http(host)
        outcome = plain[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _note_served(self, ctx: _Ctx, host: RegistryHost) -> None:
        key = (ctx.ref.registry, ctx.ref.repository)
        if self._served_by.get(key) != host.host:
            self._served_by[key] = host.host
            kind = "mirror" if host.is_mirror else "server"
            scheme = "http" if host.http_fallback and host.host in self._plain_http else host.scheme
            log.info("registry %s repository %s served by %s %s://%s%s", ctx.ref.registry,
                     ctx.ref.repository, kind, scheme, host.host, host.path)

    async def _attempt(self, host: RegistryHost, ctx: _Ctx, method: str, headers: dict[str, str],
                       handler: Callable[[httpx.Response, RegistryHost], Awaitable[T]]) -> T:
        self.stats.requests += 1
        try:
            async with self._limiter(host.host):
                with trio.fail_after(self.config.request_timeout):
                    return await self._send(host, ctx, method, headers, handler)
        except trio.TooSlowError:
            raise _AttemptError(f"timed out after {self.config.request_timeout}s", retryable=True) from None
        except AuthError as e:
            raise _AttemptError(f"authentication failed: {e}", retryable=e.retryable) from e
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise _AttemptError(f"cannot connect: {_exc_text(e)}", retryable=True, connection=True) from e
        except httpx.TimeoutException as e:
            raise _AttemptError(f"timeout: {_exc_text(e)}", retryable=True) from e
        except httpx.TransportError as e:
            raise _AttemptError(f"connection failed mid-request: {_exc_text(e)}", retryable=True) from e
        except httpx.HTTPError as e:
            raise _AttemptError(f"HTTP error: {_exc_text(e)}", retryable=False) from e

    async def _send(self, host: RegistryHost, ctx: _Ctx, method: str, headers: dict[str, str],
                    handler: Callable[[httpx.Response, RegistryHost], Awaitable[T]]) -> T:
        url = self._host_url(host, ctx)
        scope = f"repository:{ctx.ref.repository}:pull"
        reauthed = False
        redirects = 0
        while True:
            same_origin = _origin(url) == _origin(self._host_url(host, ctx))
            client = self._client(host if same_origin else None)
            req_headers = list(headers.items())
            auth: str | None = None
            if same_origin:
                # hosts.toml headers may carry secrets too: like Authorization, host-only.
                req_headers += host.header
                auth = await self.authorizer.authorization(host.host, scope, client)
                if auth:
                    req_headers.append(("Authorization", auth))
            request = client.build_request(method, url, headers=req_headers)
            try:
                if same_origin and auth is None and not host.header and self._scheme_unknown(host, url):
                    resp = await self._tls_or_plain(client, request, host)
                    url = str(resp.request.url)
                else:
                    resp = await client.send(request, stream=True)
            except httpx.ConnectError:
                # Requests that started together all tried TLS: each one that fails switches,
                # not only the first (the others would otherwise wait out a retry's backoff).
                if host.http_fallback and same_origin and url.startswith("https://"):
                    self._note_plain_http(host)
                    url = self._host_url(host, ctx)
                    continue
                raise
            try:
                if resp.status_code == 401 and same_origin:
                    if reauthed:
                        raise _AttemptError("unauthorized (401) after re-authenticating", retryable=False,
                                            status=401)
                    reauthed = True
                    retry = self.authorizer.on_unauthorized(
                        host.host, resp.headers.get_list("WWW-Authenticate"), auth)
                    if retry and await self.authorizer.authorization(host.host, scope, client):
                        continue
                    raise _AttemptError("unauthorized (401); no usable credentials", retryable=False,
                                        status=401)
                if resp.status_code in (401, 403) and not same_origin:
                    # Typically an expired pre-signed storage URL: a new attempt gets a fresh one.
                    raise _AttemptError(f"redirect target {_origin(url)[1]} refused access ({resp.status_code})",
                                        retryable=True, status=resp.status_code)
                if resp.status_code == 403:
                    raise _AttemptError("forbidden (403)", retryable=False, status=403)
                if resp.status_code in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                    redirects += 1
                    if redirects > MAX_REDIRECTS:
                        raise _AttemptError("too many redirects", retryable=False)
                    url = urljoin(str(resp.url), resp.headers["Location"])
                    if urlsplit(url).scheme not in ("http", "https"):
                        raise _AttemptError(f"redirect to unsupported URL {url!r}", retryable=False)
                    log.debug("%s: redirected to %s://%s", ctx.describe(host), *_origin(url)[:2])
                    continue
                return await handler(resp, host)
            finally:
                await resp.aclose()
