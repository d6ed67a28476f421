"""fusefs/early.py's `sent`: set once the early prefetch's event loop has its requests out (nothing
else to run) while the fetch itself goes on, not before its loop went idle, and at the end however
the prefetch ended; and its registry statistics, which the mount's stats file counts as they
arrive (fusefs/stats.py), not only once it ended. A fake reader stands in for the registry one: what
is tested is the thread and event loop bookkeeping, which the integration test
(tests/integration/test_prefetch.py) runs for real."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import trio

from snapshotter.fetch.client import FetchStatistics
from snapshotter.formats import estargz
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.index import LayerIndex
from snapshotter.fusefs.early import EarlyContext, EarlyPrefetch
from snapshotter.fusefs.ops import FsStatistics
from snapshotter.fusefs.stats import EARLY_PREFETCHES, stats_document
from tests.tars import tar_of

LAYER = "sha256:" + "e" * 64
BOUND = 10.0  # seconds any wait in these tests gets at most


def _index() -> LayerIndex:
    """A layer holding start-up files (what an early prefetch fetches)."""
    out = io.BytesIO()
    write_estargz(io.BytesIO(tar_of({"etc/passwd": b"root:x:0:0::/root:/bin/sh\n", "etc/group": b"root:x:0:\n"})),
                  out)
    blob = out.getvalue()
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    return estargz.parse_toc(blob[offset:offset + length], blob_size=len(blob), layer_digest=LAYER,
                             max_toc_bytes=1 << 20)


class _Reader:
    """fetch_chunks: claims (on_started), then `busy` seconds of CPU without yielding (sending
    its requests), then waits `answer` seconds for the answers; records when each step ended."""

    def __init__(self, busy: float, answer: float, fail: bool = False, received: int = 0) -> None:
        self.config = SimpleNamespace(unit_bytes=1 << 20, max_merge_bytes=1 << 20, max_inflight_bytes=4 << 20)
        self.cache = object()
        self.busy, self.answer, self.fail = busy, answer, fail
        self.received = received  # body bytes its client has received once its requests are out
        self.client_stats = FetchStatistics()
        self.times: dict[str, float] = {}
        self.chunks = 0

    async def fetch_chunks(self, chunks: list[Any], *, on_started: Callable[[], None], **_: Any) -> Any:
        self.chunks = len(chunks)
        on_started()
        self.times["claimed"] = time.monotonic()
        end = time.monotonic() + self.busy
        while time.monotonic() < end:
            pass
        self.client_stats.bytes_received += self.received
        self.client_stats.requests += 1
        self.times["requests_out"] = time.monotonic()
        await trio.sleep(self.answer)
        self.times["answered"] = time.monotonic()
        if self.fail:
            raise OSError("connection reset")
        return SimpleNamespace(fetched_bytes=123, requests=1)


def _early(reader: _Reader) -> EarlyPrefetch:
    @asynccontextmanager
    async def factory(spec: Any, index: LayerIndex, env: Any) -> AsyncIterator[_Reader]:
        env.shared["registry_client"] = SimpleNamespace(stats=reader.client_stats)
        yield reader

    context = EarlyContext.from_doc({"reader": {"kind": "fake", "layer_digest": LAYER}, "config": {}})
    assert context is not None
    return EarlyPrefetch(_index(), context, {"fake": factory})  # type: ignore[dict-item]


def test_sent_comes_once_the_requests_are_out_and_before_the_answers() -> None:
    reader = _Reader(busy=0.05, answer=1.0)
    early = _early(reader)
    early.start()
    assert early.wait_sent(BOUND)
    at = time.monotonic()
    assert not early.done.is_set(), "sent while the answers are still awaited"
    assert reader.chunks >= 2  # passwd and group
    assert at >= reader.times["requests_out"], "sent before the loop had its requests out"
    assert early.wait(BOUND)
    assert reader.times["answered"] > at
    assert 0.05 <= early.sent_seconds < 1.0
    assert (early.fetched_bytes, early.requests) == (123, 1)


def test_sent_is_set_when_the_prefetch_fails_before_its_loop_went_idle() -> None:
    reader = _Reader(busy=0.0, answer=0.0, fail=True)
    early = _early(reader)
    early.start()
    assert early.wait(BOUND)
    assert early.sent.is_set() and early.started.is_set()


def test_a_prefetch_answered_before_its_loop_went_idle_was_sent_when_it_ended() -> None:
    """On a fast registry the answers can arrive before the idle checks (2 ms) are done: its
    sent_seconds is then its end, never the unset -1 (seen once in CI's integration run)."""
    reader = _Reader(busy=0.0, answer=0.0)
    early = _early(reader)
    early.start()
    assert early.wait(BOUND) and early.sent.is_set()
    assert early.sent_seconds >= 0


def test_wait_sent_is_bounded() -> None:
    reader = _Reader(busy=0.3, answer=0.0)
    early = _early(reader)
    early.start()
    began = time.monotonic()
    assert early.wait_sent(0.01) is False  # still busy sending
    assert time.monotonic() - began < 0.25
    assert early.wait(BOUND) and early.sent.is_set()


def test_registry_stats_count_while_it_runs_and_in_the_mounts_stats_file() -> None:
    """A mount that stops while the early prefetch still waits for its answers reports what the
    registry sent so far (the benchmark's fetched/needed used to miss 9 MB of a landmark prefetch)."""
    reader = _Reader(busy=0.0, answer=1.0, received=9_000_000)
    early = _early(reader)
    assert early.registry_stats_so_far().bytes_received == 0
    early.start()
    assert early.wait_sent(BOUND)
    assert not early.done.is_set()
    so_far = early.registry_stats_so_far()
    assert (so_far.bytes_received, so_far.requests) == (9_000_000, 1)
    own = FetchStatistics(requests=2, bytes_received=500, bytes_by_host={"r:5000": 500})
    shared: dict[str, Any] = {"registry_client": SimpleNamespace(stats=own), EARLY_PREFETCHES: [early]}
    doc = stats_document(SimpleNamespace(mountpoint="/m", runs=()), SimpleNamespace(stats=FsStatistics()),
                         [], shared, started=0.0)  # type: ignore[arg-type]
    assert doc["registry"]["bytes_received"] == 9_000_500
    assert doc["registry"]["requests"] == 3
    assert own.bytes_received == 500, "the mount's own client's counters are left as they are"
    assert early.wait(BOUND)
    assert early.registry_stats_so_far().bytes_received == 9_000_000
