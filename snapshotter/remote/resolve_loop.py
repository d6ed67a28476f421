"""One event loop thread for the daemon's registry work, with one long-lived RegistryClient.

gRPC calls run on many threads; each lazy Prepare used to start its own trio loop and registry
client, so every layer paid for new connections (TCP, TLS), a new bearer token (a 401 and a
token request) and the loopback HTTPS probe. Here they share one client: its connection pool,
tokens, and what it learned of each host. Callers block on `run`, which runs their coroutine in
the loop (concurrent callers run concurrently). hosts.toml is read again for each job.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import trio

from snapshotter.fetch.client import RegistryClient, warm_up
from snapshotter.fetch.config import FetchConfig
from snapshotter.fetch.reference import InvalidReference, parse_reference

T = TypeVar("T")
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class ResolveLoop:
    """Thread-safe. Started on first use; `close` stops it (a later `run` starts it again)."""

    def __init__(self, fetch_config: FetchConfig) -> None:
        self._fetch_config = fetch_config
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._client: RegistryClient | None = None
        self._stop: trio.Event | None = None
        self._failure: BaseException | None = None

    def run(self, job: Callable[[RegistryClient], Awaitable[T]]) -> T:
        """`await job(client)` in the loop; returns its result or raises its exception."""
        token, client = self._ensure_started()

        async def in_loop() -> T:
            client.forget_hosts()
            return await job(client)

        return trio.from_thread.run(in_loop, trio_token=token)

    def plain_http_hosts(self) -> frozenset[str]:
        """Registry hosts the loop's client found answering plain HTTP only (empty before it ran)."""
        client = self._client
        return client.plain_http_hosts() if client is not None else frozenset()

    def auth_handoff(self, image_refs: Iterable[str]) -> dict[str, Any]:
        """The loop's client's `auth_handoff` for the repositories of these image references,
        for a mount process that reads their layers ({} before the loop ran). Any thread."""
        client = self._client
        if client is None:
            return {}
        repositories: set[str] = set()
        for ref in image_refs:
            try:
                repositories.add(parse_reference(ref).repository)
            except InvalidReference:
                continue  # the mount's own requests will say what is wrong with it
        return client.auth_handoff(sorted(repositories))

    def start_in_background(self) -> None:
        """Start the loop and build the default TLS context on a thread of their own, so the
        daemon's first Prepare does not pay for them (about 20 ms). Errors are left for the
        first `run` to meet and report."""

        def start() -> None:
            try:
                self._ensure_started()
                warm_up()
            except Exception:  # the first run() starts it again and raises
                pass

        threading.Thread(target=start, name="resolve-loop-start", daemon=True).start()

    def _ensure_started(self) -> tuple[trio.lowlevel.TrioToken, RegistryClient]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                ready = threading.Event()
                self._token = self._client = None
                self._failure = None
                self._thread = threading.Thread(target=self._main, args=(ready,), name="resolve-loop", daemon=True)
                self._thread.start()
                if not ready.wait(START_TIMEOUT) or self._token is None or self._client is None:
                    raise RuntimeError(f"the resolve loop did not start: {self._failure!r}")
            assert self._token is not None and self._client is not None
            return self._token, self._client

    def _main(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._stop = trio.Event()
            async with RegistryClient(self._fetch_config) as client:
                self._client = client
                self._token = trio.lowlevel.current_trio_token()
                ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the caller waiting in _ensure_started
            self._failure = exc
        finally:
            ready.set()

    def close(self) -> None:
        """Stop the loop (jobs still running are cancelled with it) and close the client."""
        with self._lock:
            thread, token, stop = self._thread, self._token, self._stop
            self._thread = self._token = self._client = None
        if thread is None or token is None or stop is None:
            return
        try:
            trio.from_thread.run_sync(stop.set, trio_token=token)
        except trio.RunFinishedError:
            pass
        thread.join(STOP_TIMEOUT)
