"""The spare's early prefetch: a layer's prefetch started while its image is still being pulled.

The daemon hands the spare each lazy layer's metadata to parse (fusefs/spare.py preloads). When
the preload also carries an "early" object (below: what a mount's registry reader of that layer
needs), the spare, right after parsing the layer, starts fetching what the image's mount would
prefetch from it first: its prefetch list (landmark or prefetch table) and the start-up files it
holds by its own names (startup_files.py `layer_startup_entries`), into the shared chunk cache,
on a thread of its own. The daemon still has the layer to persist, containerd the image to record
and the runtime the container to create: at +50 ms per round trip this took the start-up files'
round trip off a cold `true`'s path (the mount used to fetch them only once it served).

The mount the spare is assigned waits, before its own prefetch, for the early prefetches of its
layers to end (at most its prefetch_timeout); its prefetch then finds those chunks cached, and
counts what the early one fetched as its own (`Prefetcher.credit`). A read that needs a chunk the
early prefetch is still fetching waits for that fetch (the process's shared flights,
reader/shared_flights.py), not sending a request of its own; a file an upper layer replaces was
fetched for nothing (the mount fetches the merged tree's start-up files).
An early prefetch that fails only costs the mount's own prefetch, as before. The daemon sends
"early" only with `mount_on_pull`, under which the pulled image's mount prefetches these files on
pull anyway.

The preload's "early" object:
    {"reader": {"kind": "registry", "image_ref": REF, "layer_digest": D, ...},   the layer's reader
     "config": {...}, "plain_http_hosts": [HOST, ...], "auth": HANDOFF}       as a mount's state
                                                                              and assignment
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import trio

from snapshotter.fetch.client import FetchStatistics
from snapshotter.formats.index import LayerIndex
from snapshotter.fusefs.prefetch import PREFETCH_MAX_GAP, PrefetchSettings, listed_prefetch, prefetch_chunks
from snapshotter.fusefs.process import ReaderEnv, ReaderFactory
from snapshotter.fusefs.startup_files import layer_startup_entries
from snapshotter.fusefs.state import LayerSpec, MountState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EarlyContext:
    """One layer's "early" object (see the module docstring)."""

    reader: Mapping[str, Any]
    config: Mapping[str, Any]
    plain_http_hosts: tuple[str, ...]
    auth: Mapping[str, Any]

    @classmethod
    def from_doc(cls, doc: object) -> EarlyContext | None:
        """The context, or None when `doc` is not a well-formed "early" object."""
        if not isinstance(doc, Mapping):
            return None
        reader, config, hosts, auth = doc.get("reader"), doc.get("config"), doc.get("plain_http_hosts", []), \
            doc.get("auth", {})
        if not (isinstance(reader, Mapping) and isinstance(reader.get("layer_digest"), str)
                and isinstance(config, Mapping) and isinstance(hosts, list) and isinstance(auth, Mapping)):
            return None
        return cls(reader, config, tuple(h for h in hosts if isinstance(h, str)), auth)


# While an early prefetch runs, the spare's main thread parses, writes indexes and builds trees:
# CPU-bound, it keeps the GIL for the interpreter's switch interval (5 ms) each time this thread,
# back from a socket or epoll call, asks for it, and the prefetch, which does dozens of such calls
# before its requests are out, took 130 ms to send them instead of 10. Shorter turns while it runs.
EARLY_SWITCH_INTERVAL = 0.0005
# Shorter turns were not enough: with the spare building the image's tree (55 ms of CPU) right
# after the parse, the early prefetch's requests went out only once the tree was built (at +50 ms
# per round trip, the start-up files then came 60 ms later than they could). So the spare waits
# for `sent` (at most fusefs/spare.py EARLY_SENT_WAIT) before it builds the tree: the prefetch's
# event loop found with no other task to run at SENT_IDLE_CHECKS checks in a row, SENT_CHECK_SECONDS
# apart, means its requests are out (its tasks wait for answers, or for worker threads).
# (trio.testing.wait_all_tasks_blocked says the same, but importing it costs 50-60 ms of CPU.)
SENT_CHECK_SECONDS = 0.001
SENT_IDLE_CHECKS = 2
_turns_lock = threading.Lock()
_turns_users = 0
_turns_saved = 0.0


@contextmanager
def _short_gil_turns() -> Iterator[None]:
    global _turns_users, _turns_saved
    with _turns_lock:
        if _turns_users == 0:
            _turns_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_turns_saved, EARLY_SWITCH_INTERVAL))
        _turns_users += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns_users -= 1
            if _turns_users == 0:
                sys.setswitchinterval(_turns_saved)


class EarlyPrefetch:
    """The early prefetch of one layer (`index`, with its `context`), through a reader of
    `reader_kinds`. `start()` runs it on a daemon thread; `started` is set once its chunks are
    claimed in the process's shared flights (reads of them wait for its fetch) or it has ended,
    `sent` once, after that, its event loop has had nothing else to run for a few ms (its requests
    are out: it waits for answers or for its worker threads) or it has ended, `done`
    once it has ended, however it ended; then `fetched_bytes` and `requests` say what it fetched."""

    def __init__(self, index: LayerIndex, context: EarlyContext, reader_kinds: Mapping[str, ReaderFactory]) -> None:
        self.index = index
        self.context = context
        self.reader_kinds = reader_kinds
        self.layer_digest = str(context.reader["layer_digest"])
        self.started = threading.Event()
        self.sent = threading.Event()
        self.done = threading.Event()
        self.fetched_bytes = 0
        self.requests = 0
        self.sent_seconds = -1.0  # from start() until `sent` (its event loop idle, or its end)
        self._began = time.monotonic()
        self.registry_stats = FetchStatistics()  # its registry client's, once it has ended
        self._live_stats: FetchStatistics | None = None  # that client's, while it runs

    def start(self) -> None:
        log.info("event=early_prefetch_started layer=%s", self.layer_digest)
        self._began = time.monotonic()
        threading.Thread(target=self._run, name="early-prefetch", daemon=True).start()

    def wait(self, timeout: float) -> bool:
        """Wait until it has ended, at most `timeout` seconds; whether it has."""
        return self.done.wait(timeout)

    def wait_sent(self, timeout: float) -> bool:
        """Wait until its requests are out (`sent`), at most `timeout` seconds; whether they are."""
        return self.sent.wait(timeout)

    def registry_stats_so_far(self) -> FetchStatistics:
        """What its registry client has received so far (from any thread; all of it once ended)."""
        live = self._live_stats
        if self.done.is_set() or live is None:
            return self.registry_stats
        return FetchStatistics(requests=live.requests, range_requests=live.range_requests,
                               multi_range_requests=live.multi_range_requests, retries=live.retries,
                               bytes_received=live.bytes_received, bytes_by_host=dict(live.bytes_by_host))

    def _run(self) -> None:
        began = self._began
        try:
            with _short_gil_turns():
                status, files = trio.run(self._prefetch)
        except BaseException as exc:  # noqa: BLE001  # an early prefetch only ever saves time
            log.warning("event=early_prefetch layer=%s status=failed error=%r seconds=%.3f", self.layer_digest,
                        str(exc), time.monotonic() - began)
        else:
            seconds = time.monotonic() - began
            if self.sent_seconds < 0:  # answered before its loop was seen idle: `sent` is its end
                self.sent_seconds = seconds
            log.info("event=early_prefetch layer=%s status=%s files=%d bytes=%d requests=%d seconds=%.3f "
                     "sent_seconds=%.3f", self.layer_digest, status, files, self.fetched_bytes, self.requests,
                     seconds, self.sent_seconds)
        finally:
            self.started.set()
            self.sent.set()
            self.done.set()

    async def _prefetch(self) -> tuple[str, int]:
        ctx = self.context
        doc: dict[str, Any] = {"config": dict(ctx.config), "plain_http_hosts": list(ctx.plain_http_hosts)}
        settings = PrefetchSettings.from_doc(doc)
        startup = layer_startup_entries(self.index) if settings.startup_files else []
        if not startup and not listed_prefetch(self.index):
            return "nothing", 0
        spec = LayerSpec(index_path="", reader=ctx.reader, digest=self.layer_digest)
        state = MountState(mountpoint="", runs=((spec,),), doc=doc)
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            env = ReaderEnv(nursery=nursery, stack=stack, state=state, auth=dict(ctx.auth))
            factory = self.reader_kinds[str(ctx.reader.get("kind"))]
            reader: Any = await stack.enter_async_context(factory(spec, self.index, env))
            live_client = env.shared.get("registry_client")
            if live_client is not None:
                self._live_stats = live_client.stats
            if not hasattr(reader, "fetch_chunks") or getattr(reader, "cache", None) is None:
                return "no_cache", 0
            cfg = reader.config
            files, chunks = prefetch_chunks(self.index, cfg.unit_bytes, startup)
            max_run = max(cfg.max_merge_bytes, cfg.max_inflight_bytes // 4)
            claimed = trio.Event()

            def on_started() -> None:
                self.started.set()
                claimed.set()

            async def note_sent() -> None:
                await claimed.wait()
                idle_checks = 0
                while idle_checks < SENT_IDLE_CHECKS:
                    await trio.sleep(SENT_CHECK_SECONDS)
                    idle = trio.lowlevel.current_statistics().tasks_runnable == 0
                    idle_checks = idle_checks + 1 if idle else 0
                self.sent_seconds = time.monotonic() - self._began
                self.sent.set()

            nursery.start_soon(note_sent)
            status = "timeout"
            try:
                with trio.move_on_after(settings.prefetch_timeout):
                    tally = await reader.fetch_chunks(chunks, pin=True, max_gap=PREFETCH_MAX_GAP,
                                                      max_run_bytes=max_run, on_started=on_started)
                    self.fetched_bytes, self.requests = tally.fetched_bytes, tally.requests
                    status = "done"
            finally:
                client = env.shared.get("registry_client")
                if client is not None:
                    self.registry_stats.add(client.stats)
            return status, files
