"""Fetches shared between event loops of one process (reader/shared_flights.py): a read on one
loop waits for the chunk another loop's reader is fetching into the same cache, instead of
asking the source again, and still gets its bytes when that fetch fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from snapshotter.cache import ChunkCache
from snapshotter.reader import LayerReader, ReaderConfig
from snapshotter.reader.shared_flights import SharedFlights
from tests.blob.blobs import BuiltBlob, build_blob
from tests.blob.test_reader import CHUNK, LAYER, CountingSource, all_chunks, make_files

BOUND = 30.0  # seconds any wait of these tests may take at most


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> BuiltBlob:
    return build_blob(tmp_path_factory.mktemp("shared") / "layer.blob", make_files(3), chunk_size=CHUNK)


class GatedSource(CountingSource):
    """Answers only once `gate` is set (a fetch held in flight), then as CountingSource; `asked`
    is set at its first request."""

    def __init__(self, paths: list[Path], *, fail: bool = False) -> None:
        super().__init__(paths)
        self.gate = threading.Event()
        self.asked = threading.Event()
        self.fail = fail

    async def read_range(self, blob: int, offset: int, length: int) -> bytes:
        self.asked.set()
        await trio.to_thread.run_sync(self.gate.wait, BOUND)
        if self.fail:
            raise OSError("connection reset (the test's failing source)")
        return await super().read_range(blob, offset, length)


def _prefetch_on_thread(reader: LayerReader, blob: BuiltBlob,
                        name: str) -> tuple[threading.Thread, list[BaseException]]:
    """`reader` prefetches file `name` into the cache on a thread with its own trio loop, as
    the spare's early prefetch does."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            trio.run(reader.prefetch, blob.entries[name])
        except BaseException as exc:  # noqa: BLE001  (reported to the test)
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_a_read_waits_for_the_chunk_another_loop_fetches(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    flights = SharedFlights()
    early_source = GatedSource([blob.path])
    early = LayerReader(early_source, blobs=[LAYER], cache=cache, shared=flights)
    thread, errors = _prefetch_on_thread(early, blob, "big")
    assert early_source.asked.wait(BOUND)

    main_source = CountingSource([blob.path])
    main = LayerReader(main_source, blobs=[LAYER], cache=ChunkCache(tmp_path / "cache", 1 << 30), shared=flights)
    entry = blob.entries["big"]

    async def read_while_held() -> bytes:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                got: list[bytes] = []

                async def read() -> None:
                    got.append(await main.read(entry, CHUNK + 5, 2 * CHUNK))

                nursery.start_soon(read)
                await trio.sleep(0.2)
                assert not got  # still waiting for the other loop's fetch
                early_source.gate.set()
            return got[0]

    assert trio.run(read_while_held) == blob.contents["big"][CHUNK + 5:3 * CHUNK + 5]
    thread.join(BOUND)
    assert not thread.is_alive() and errors == []
    assert main_source.calls == []  # every byte came from the other loop's fetch
    assert main.stats.shared_waits > 0
    counts = early_source.fetches_per_chunk(all_chunks(blob))
    assert counts and max(counts.values()) == 1


def test_a_failed_fetch_on_the_other_loop_leaves_the_read_to_fetch_itself(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    flights = SharedFlights()
    early_source = GatedSource([blob.path], fail=True)
    early = LayerReader(early_source, blobs=[LAYER], cache=cache, shared=flights,
                        config=ReaderConfig(fetch_timeout=BOUND))
    thread, errors = _prefetch_on_thread(early, blob, "exact")
    assert early_source.asked.wait(BOUND)

    main_source = CountingSource([blob.path])
    main = LayerReader(main_source, blobs=[LAYER], cache=cache, shared=flights)
    entry = blob.entries["exact"]

    async def read_then_fail_the_other() -> bytes:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                got: list[bytes] = []

                async def read() -> None:
                    got.append(await main.read(entry, 0, entry.size))

                nursery.start_soon(read)
                await trio.sleep(0.2)
                assert not got and main_source.calls == []
                early_source.gate.set()  # the other loop's fetch fails now
            return got[0]

    assert trio.run(read_then_fail_the_other) == blob.contents["exact"]
    thread.join(BOUND)
    assert not thread.is_alive()
    assert errors, "the failing prefetch should have raised"
    assert main_source.calls  # it fetched the chunks itself


def test_claims_are_per_owner_and_scope_and_end_on_release() -> None:
    flights = SharedFlights()
    a, b = object(), object()
    assert flights.claim("/cache", ["k1", "k2"], a) == []
    assert flights.claim("/cache", ["k2", "k3"], b) == ["k2"]  # k3 is b's now
    assert flights.claim("/cache", ["k1"], a) == []  # a's own claim
    assert flights.claim("/other", ["k1"], b) == []  # another cache: unrelated
    flights.release("/cache", ["k1", "k2", "k3"], a)  # k3 is b's: stays
    assert not flights.held("/cache", "k1") and not flights.held("/cache", "k2")
    assert flights.held("/cache", "k3")


def test_a_wait_ends_at_release_from_another_thread_or_at_its_timeout() -> None:
    flights = SharedFlights()
    owner = object()
    flights.claim("/c", ["k"], owner)

    async def wait_released() -> float:
        began = trio.current_time()
        threading.Timer(0.1, flights.release, args=("/c", ["k"], owner)).start()
        await flights.wait("/c", ["k"], BOUND)
        return trio.current_time() - began

    assert trio.run(wait_released) < BOUND / 2
    flights.claim("/c", ["k"], owner)

    async def wait_timeout() -> float:
        began = trio.current_time()
        await flights.wait("/c", ["k"], 0.1)
        return trio.current_time() - began

    assert 0.1 <= trio.run(wait_timeout) < BOUND
    assert flights.held("/c", "k")
