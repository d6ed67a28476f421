"""LayerReader over a file-backed RangeSource: bytes, single flight, verification, timeouts."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.cache import ChunkCache
from snapshotter.errors import DigestMismatch, FetchError, FormatError
from snapshotter.formats.index import Chunk, Entry
from snapshotter.reader import (
    BlobOrder,
    FileRangeSource,
    LayerReader,
    ReaderConfig,
    cache_keys,
    chunk_key,
    open_layer_reader,
)
from snapshotter.reader.layer import AMPLIFY_FREE_MISSES
from snapshotter.reader.source import RangeSink
from tests.blob.blobs import BuiltBlob, build_blob, file_bytes

CHUNK = 64 << 10
LAYER = "sha256:" + "1" * 64
# For tests of the reader's mechanics chunk by chunk (requests, read-ahead, warming per chunk):
# grouping small chunks into read units, on by default, is tested in test_units.py.
CHUNKWISE = ReaderConfig(unit_bytes=0)


def make_files(seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "big": file_bytes(rng, 20 * CHUNK + 1234),
        "small": file_bytes(rng, 300),
        "exact": file_bytes(rng, 3 * CHUNK),
        "empty": b"",
    }


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> BuiltBlob:
    d = tmp_path_factory.mktemp("blobtest")  # pytest keeps the last few runs' dirs, not every one
    return build_blob(d / "layer.blob", make_files(), chunk_size=CHUNK)


class CountingSource(FileRangeSource):
    """Records every range asked for; can corrupt answers, delay them, or hang."""

    def __init__(self, paths: Sequence[Path], *, delay: float = 0.0) -> None:
        super().__init__(paths)
        self.calls: list[tuple[int, int, int]] = []
        self.delay = delay
        self.corrupt_times = 0  # corrupt this many answers (one byte flipped mid-range)
        self.hang = False
        self.outstanding = 0
        self.max_outstanding = 0

    async def read_range(self, blob: int, offset: int, length: int) -> bytes:
        self.calls.append((blob, offset, length))
        self.outstanding += length
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        try:
            if self.hang:
                await trio.sleep_forever()
            if self.delay:
                await trio.sleep(self.delay)
            data = await super().read_range(blob, offset, length)
        finally:
            self.outstanding -= length
        if self.corrupt_times > 0:
            self.corrupt_times -= 1
            mid = length // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        return data

    async def stream_range(self, blob: int, offset: int, length: int, sink: RangeSink) -> None:
        """The same answer (with the faults above) to a streaming reader, in uneven pieces."""
        view = memoryview(await self.read_range(blob, offset, length))
        pos = 0
        while pos < length:
            n = 1 + (pos * 7919 + 100_003) % (3 * CHUNK // 2)
            await sink.write(view[pos:pos + n])
            pos += n

    def fetches_per_chunk(self, chunks: Sequence[Chunk]) -> Counter[int]:
        """How many requested ranges covered each chunk (by blob offset)."""
        count: Counter[int] = Counter()
        for c in chunks:
            for _, off, n in self.calls:
                if off <= c.blob_offset and c.blob_offset + c.blob_size <= off + n:
                    count[c.blob_offset] += 1
        return count


def all_chunks(b: BuiltBlob) -> list[Chunk]:
    return [c for e in b.entries.values() for c in e.chunks]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["big", "small", "exact", "empty"]),
    offset=st.integers(0, 22 * CHUNK),
    size=st.integers(0, 5 * CHUNK),
    use_cache=st.booleans(),
    merge=st.sampled_from([1, CHUNK, 4 << 20]),
)
def test_random_reads_match_file(
    blob: BuiltBlob, tmp_path: Path, name: str, offset: int, size: int, use_cache: bool, merge: int
) -> None:
    cache = ChunkCache(tmp_path / "cache", 4 * CHUNK) if use_cache else None
    expected = blob.contents[name][offset:offset + size]

    async def main() -> bytes:
        reader = LayerReader(
            FileRangeSource([blob.path]), blobs=[LAYER], cache=cache, config=ReaderConfig(max_merge_bytes=merge)
        )
        first = await reader.read(blob.entries[name], offset, size)
        again = await reader.read(blob.entries[name], offset, size)  # possibly from the cache
        assert again == first
        return first

    assert trio.run(main) == expected
    if cache is not None:
        assert cache.usage().bytes <= 4 * CHUNK


def test_concurrent_readers_fetch_each_chunk_once(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    source = CountingSource([blob.path], delay=0.01)
    rng = random.Random(5)
    reads = [(n, rng.randrange(len(blob.contents[n]) or 1), rng.randrange(1, 3 * CHUNK))
             for n in ("big", "exact", "small") for _ in range(40)]
    results: dict[int, bytes] = {}

    async def main() -> None:
        reader = LayerReader(source, blobs=[LAYER], cache=cache)

        async def one(i: int, name: str, off: int, size: int) -> None:
            results[i] = await reader.read(blob.entries[name], off, size)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i, (name, off, size) in enumerate(reads):
                    nursery.start_soon(one, i, name, off, size)

    trio.run(main)
    for i, (name, off, size) in enumerate(reads):
        assert results[i] == blob.contents[name][off:off + size]
    counts = source.fetches_per_chunk(all_chunks(blob))
    assert counts and max(counts.values()) == 1, counts


def test_single_flight_without_cache(blob: BuiltBlob) -> None:
    source = CountingSource([blob.path], delay=0.05)
    entry = blob.entries["exact"]

    async def main() -> list[bytes]:
        reader = LayerReader(source, blobs=[LAYER], cache=None)
        out: list[bytes] = []

        async def one() -> None:
            out.append(await reader.read(entry, 0, entry.size))

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(one)
        return out

    out = trio.run(main)
    assert out == [blob.contents["exact"]] * 20
    assert len(source.calls) == 1  # three adjacent chunks, one merged request, shared by all 20


def test_corrupt_source_refetches_once_then_digest_mismatch(blob: BuiltBlob, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    source = CountingSource([blob.path])
    entry = blob.entries["small"]
    source.corrupt_times = 1_000

    async def read() -> bytes:
        reader = LayerReader(source, blobs=[LAYER], cache=cache)
        return await reader.read(entry, 0, entry.size)

    with pytest.raises(DigestMismatch):
        trio.run(read)
    assert len(source.calls) == 2
    assert cache.usage().chunks == 0 and cache.get(entry.chunks[0].digest or "") is None
    (line,) = [r.getMessage() for r in caplog.records if "event=chunk_corrupt" in r.getMessage()]
    chunk = entry.chunks[0]
    assert f"blob={LAYER}" in line and f"range={chunk.blob_offset}+{chunk.blob_size}" in line

    # Corrupt once only: the refetch heals it, and only good bytes are cached.
    source.calls.clear()
    source.corrupt_times = 1
    assert trio.run(read) == blob.contents["small"]
    assert len(source.calls) == 2
    assert cache.get(entry.chunks[0].digest or "") == blob.contents["small"]


def test_corrupt_cached_chunk_is_not_served_with_verify_cached(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    entry = blob.entries["small"]
    key = entry.chunks[0].digest or ""
    cache.put(key, b"x" * entry.size)  # same size, wrong bytes: only a digest check catches it

    async def read() -> bytes:
        reader = LayerReader(
            FileRangeSource([blob.path]), blobs=[LAYER], cache=cache, config=ReaderConfig(verify_cached=True)
        )
        return await reader.read(entry, 0, entry.size)

    assert trio.run(read) == blob.contents["small"]
    assert cache.get(key) == blob.contents["small"]


def test_fetch_timeout_raises_fetch_error_within_bound(blob: BuiltBlob) -> None:
    source = CountingSource([blob.path])
    source.hang = True
    entry = blob.entries["big"]
    errors: list[BaseException] = []

    async def main() -> float:
        reader = LayerReader(source, blobs=[LAYER], cache=None, config=ReaderConfig(fetch_timeout=0.3))
        start = trio.current_time()

        async def one() -> None:
            try:
                await reader.read(entry, 0, 1000)
            except FetchError as exc:
                errors.append(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for _ in range(3):  # one leader, two waiters: all get the error
                    nursery.start_soon(one)
        return trio.current_time() - start

    elapsed = trio.run(main)
    assert len(errors) == 3
    assert elapsed < 1.5
    assert len(source.calls) == 1


def test_leader_cancelled_waiter_takes_over(blob: BuiltBlob) -> None:
    source = CountingSource([blob.path], delay=0.2)
    entry = blob.entries["small"]

    async def main() -> bytes | None:
        reader = LayerReader(source, blobs=[LAYER], cache=None)
        result: list[bytes] = []

        async def waiter() -> None:
            result.append(await reader.read(entry, 0, entry.size))

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as leader:
                async with trio.open_nursery() as inner:
                    inner.start_soon(reader.read, entry, 0, entry.size)
                    await trio.testing.wait_all_tasks_blocked()  # its fetch is in flight
                    nursery.start_soon(waiter)
                    await trio.testing.wait_all_tasks_blocked()  # the waiter waits on that fetch
                    assert len(source.calls) == 1
                    leader.cancel()  # the leader gives up (a FUSE interrupt)
        return result[0] if result else None

    assert trio.run(main) == blob.contents["small"]
    assert len(source.calls) == 2


def test_memory_budget_bounds_bytes_in_flight(blob: BuiltBlob) -> None:
    source = CountingSource([blob.path], delay=0.02)
    entry = blob.entries["big"]
    biggest = max(c.blob_size + c.inner_offset + c.size for c in entry.chunks)
    budget = 2 * biggest
    config = ReaderConfig(max_inflight_bytes=budget, max_merge_bytes=1, unit_bytes=0)

    async def main() -> None:
        reader = LayerReader(source, blobs=[LAYER], cache=None, config=config)
        async with trio.open_nursery() as nursery:
            for c in entry.chunks:
                nursery.start_soon(reader.read, entry, c.file_offset, c.size)

    trio.run(main)
    assert len(source.calls) == len(entry.chunks)
    assert source.max_outstanding <= budget


async def _read_first_two_chunks(reader: LayerReader, blob: BuiltBlob, entry: Entry) -> None:
    """Read the file's first two chunks in 32 KiB steps, checking each piece: a sequential
    reader, as the kernel's read-ahead makes one."""
    step = 32 << 10
    for off in range(0, 2 * CHUNK, step):
        assert await reader.read(entry, off, step) == blob.contents["big"][off:off + step]


def test_sequential_reads_trigger_readahead(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    source = CountingSource([blob.path])
    entry = blob.entries["big"]
    config = ReaderConfig(readahead_bytes=6 * CHUNK, readahead_trigger=2, max_merge_bytes=1)

    async def main() -> None:
        async with open_layer_reader(source, blobs=[LAYER], cache=cache, config=config) as reader:
            await _read_first_two_chunks(reader, blob, entry)
            with trio.fail_after(10):
                while reader.stats.readahead_chunks < 4:
                    await trio.sleep(0.01)
            before = len(source.calls)
            # The next chunks come from the cache: no new requests for them.
            got = await reader.read(entry, 2 * CHUNK, 3 * CHUNK)
            assert got == blob.contents["big"][2 * CHUNK:5 * CHUNK]
            assert len(source.calls) == before or all(off >= 5 * CHUNK for _, off, _ in source.calls[before:])

    trio.run(main)
    counts = source.fetches_per_chunk(entry.chunks)
    assert max(counts.values()) == 1


def test_sequential_reads_of_cached_chunks_start_their_disk_reads_ahead(blob: BuiltBlob, tmp_path: Path) -> None:
    """Read-ahead over chunks already cached fetches nothing and warms their files instead."""
    cache = ChunkCache(tmp_path, 1 << 30)
    source = CountingSource([blob.path])
    entry = blob.entries["big"]
    config = ReaderConfig(readahead_bytes=6 * CHUNK, readahead_trigger=2, max_merge_bytes=1, unit_bytes=0)

    async def main() -> None:
        async with open_layer_reader(source, blobs=[LAYER], cache=cache, config=CHUNKWISE) as reader:
            await reader.prefetch(entry)
            keys = {reader.key_for(c) for c in entry.chunks}
            with trio.fail_after(10):  # the cache writes finish in the background
                while cache.present(keys) != keys:
                    await trio.sleep(0.01)
        fetched = len(source.calls)
        async with open_layer_reader(source, blobs=[LAYER], cache=cache, config=config) as reader:
            await _read_first_two_chunks(reader, blob, entry)
            with trio.fail_after(10):
                while reader.stats.readahead_warmed < 4:
                    await trio.sleep(0.01)
            assert reader.stats.readahead_chunks == 0
        assert len(source.calls) == fetched

    trio.run(main)



def test_sequential_reads_finishing_out_of_order_keep_one_read_ahead_stream(blob: BuiltBlob, tmp_path: Path) -> None:
    """The kernel sends a sequential reader's reads as concurrent requests that finish in any
    order: 256 KiB reads noted pairwise swapped still form one stream, and each chunk of the
    window is warmed once, not again after every swap."""
    cache = ChunkCache(tmp_path, 1 << 30)
    entry = blob.entries["big"]
    step = 4 * CHUNK
    order = [step, 0, 3 * step, 2 * step, 4 * step]
    warmed: Counter[str] = Counter()
    real_warm = cache.warm

    def counting_warm(keys: list[str]) -> set[str]:
        warmed.update(keys)
        return real_warm(keys)

    async def main() -> int:
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                                     config=CHUNKWISE) as reader:
            await reader.prefetch(entry)
            keys = {reader.key_for(c) for c in entry.chunks}
            with trio.fail_after(10):  # the cache writes finish in the background
                while cache.present(keys) != keys:
                    await trio.sleep(0.01)
        cache.warm = counting_warm  # type: ignore[method-assign]
        config = ReaderConfig(readahead_bytes=3 * step, readahead_trigger=2, unit_bytes=0)
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                                     config=config) as reader:
            for off in order:
                assert await reader.read(entry, off, step) == blob.contents["big"][off:off + step]
                await trio.sleep(0.05)  # let the read-ahead task run
            return reader.stats.readahead_warmed

    warmed_total = trio.run(main)
    assert warmed and max(warmed.values()) == 1, warmed
    # The stream began with the second read (0 to `step`): every chunk after it was warmed ahead.
    assert warmed_total == sum(1 for c in entry.chunks if c.file_offset >= step)


def test_read_ahead_reads_a_windows_cached_chunks_into_memory_on_several_threads(blob: BuiltBlob,
                                                                                tmp_path: Path) -> None:
    """One thread going from one chunk file to the next keeps the disk half idle: the window's
    cached chunks are warmed by several threads at once, each chunk once, nearest first."""
    cache = ChunkCache(tmp_path, 1 << 30)
    entry = blob.entries["big"]
    calls: list[list[str]] = []
    active = [0, 0]  # now, most at once
    lock = threading.Lock()
    real_warm = cache.warm

    def slow_warm(keys: list[str]) -> set[str]:
        with lock:
            calls.append(list(keys))
            active[0] += 1
            active[1] = max(active[1], active[0])
        time.sleep(0.1)  # a slow disk
        try:
            return real_warm(keys)
        finally:
            with lock:
                active[0] -= 1

    all_keys: list[str] = []

    async def main() -> tuple[list[str], int]:
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                                     config=CHUNKWISE) as reader:
            await reader.prefetch(entry)
            all_keys.extend(reader.key_for(c) for c in entry.chunks)
            keys = set(all_keys)
            with trio.fail_after(10):  # the cache writes finish in the background
                while cache.present(keys) != keys:
                    await trio.sleep(0.01)
        cache.warm = slow_warm  # type: ignore[method-assign]
        config = ReaderConfig(readahead_bytes=len(entry.chunks) * CHUNK, readahead_trigger=2, unit_bytes=0)
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                                     config=config) as reader:
            await _read_first_two_chunks(reader, blob, entry)
            ahead = [reader.key_for(c) for c in entry.chunks[2:]]
            with trio.fail_after(10):
                while reader.stats.readahead_warmed < len(ahead):
                    await trio.sleep(0.01)
            return ahead, reader.stats.readahead_chunks

    ahead, fetched_ahead = trio.run(main)
    assert fetched_ahead == 0
    warmed = [k for keys in calls for k in keys]
    assert len(warmed) == len(set(warmed)), "a chunk was warmed twice"
    assert set(ahead) <= set(warmed), "a chunk of the window was not warmed"
    assert active[1] > 1, "the window was warmed one chunk file at a time"
    # One window (it reaches the file's end), warmed by one call per thread, each starting with
    # one of the window's nearest chunks (thread i takes every n-th chunk from the i-th on).
    order = {k: i for i, k in enumerate(all_keys)}
    firsts = sorted(order[keys[0]] for keys in calls)
    assert firsts == list(range(firsts[0], firsts[0] + len(firsts))), firsts


def test_a_read_across_cached_chunks_is_read_into_one_buffer(blob: BuiltBlob, tmp_path: Path) -> None:
    """The parts of a read spanning chunks whose files are open and in the page cache land in
    one buffer, read straight from the files: no per-chunk pieces to join."""
    cache = ChunkCache(tmp_path, 1 << 30, touch_interval=3600)
    entry = blob.entries["big"]
    want = blob.contents["big"]

    async def main() -> None:
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                                     config=ReaderConfig(readahead_bytes=0)) as reader:
            for c in entry.chunks[:4]:  # fetched, then served from the cache: the files are open
                assert await reader.read(entry, c.file_offset, 1) == want[c.file_offset:c.file_offset + 1]
                assert await reader.read(entry, c.file_offset, 1) == want[c.file_offset:c.file_offset + 1]

            def no(*args: object) -> None:
                raise AssertionError("read piece by piece")

            cache.get_resident = no  # type: ignore[method-assign]
            cache.get = no  # type: ignore[method-assign]
            hits = reader.stats.cache_hits
            lo, hi = CHUNK // 2, 3 * CHUNK + 100  # parts of four chunks
            assert await reader.read(entry, lo, hi - lo) == want[lo:hi]
            assert reader.stats.cache_hits == hits + 4

    trio.run(main)


def test_two_layers_sharing_content_store_it_once(tmp_path: Path) -> None:
    files = make_files(7)
    a = build_blob(tmp_path / "a.blob", files, chunk_size=CHUNK, seed=1)
    b = build_blob(tmp_path / "b.blob", {"renamed": files["big"]}, chunk_size=CHUNK, seed=2, lead=b"other layer")
    assert a.path.read_bytes() != b.path.read_bytes()
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    src_b = CountingSource([b.path])

    async def main() -> None:
        # Chunk by chunk: the two blobs' different inner offsets group their chunks differently
        # (test_units.py shows a file grouped alike in two layers stored once).
        ra = LayerReader(FileRangeSource([a.path]), blobs=["sha256:" + "a" * 64], cache=cache, config=CHUNKWISE)
        rb = LayerReader(src_b, blobs=["sha256:" + "b" * 64], cache=cache, config=CHUNKWISE)
        e = a.entries["big"]
        assert await ra.read(e, 0, e.size) == files["big"]
        used = cache.usage()
        assert used.bytes == len(files["big"])
        e2 = b.entries["renamed"]
        assert await rb.read(e2, 0, e2.size) == files["big"]
        assert cache.usage() == used

    trio.run(main)
    assert src_b.calls == []


def test_digestless_chunks_keyed_by_blob_position(tmp_path: Path) -> None:
    files = make_files(3)
    b = build_blob(tmp_path / "n.blob", files, chunk_size=CHUNK, digests=False)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    source = CountingSource([b.path])

    async def main() -> None:
        for _ in range(2):
            reader = LayerReader(source, blobs=[LAYER], cache=cache)
            for name, e in b.entries.items():
                assert await reader.read(e, 0, e.size) == files[name]

    trio.run(main)
    assert cache.usage().chunks == sum(len(e.chunks) for e in b.entries.values())
    assert max(source.fetches_per_chunk(all_chunks(b)).values()) == 1


def test_unsupported_digest_and_short_source(tmp_path: Path, blob: BuiltBlob) -> None:
    e = blob.entries["small"]
    c = e.chunks[0]
    bad = Entry(name="x", type=e.type, size=e.size, chunks=(Chunk(
        file_offset=0, size=c.size, blob_offset=c.blob_offset, blob_size=c.blob_size,
        compression=c.compression, digest="sha512:" + "0" * 128, inner_offset=c.inner_offset),))
    beyond = Entry(name="y", type=e.type, size=e.size, chunks=(Chunk(
        file_offset=0, size=c.size, blob_offset=blob.path.stat().st_size - 10, blob_size=100,
        compression=c.compression, digest=c.digest),))

    async def read(entry: Entry) -> bytes:
        reader = LayerReader(FileRangeSource([blob.path]), blobs=[LAYER], cache=None)
        return await reader.read(entry, 0, entry.size)

    with pytest.raises(FormatError):
        trio.run(read, bad)
    with pytest.raises(FetchError):
        trio.run(read, beyond)


def test_file_source_digest_of_whole_read_matches(blob: BuiltBlob) -> None:
    async def main() -> str:
        reader = LayerReader(FileRangeSource([blob.path]), blobs=[LAYER], cache=None)
        e = blob.entries["big"]
        h = hashlib.sha256()
        for off in range(0, e.size, 100_000):
            h.update(await reader.read(e, off, 100_000))
        return h.hexdigest()

    assert trio.run(main) == hashlib.sha256(blob.contents["big"]).hexdigest()


def test_prefetch_with_pin_survives_eviction(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    source = CountingSource([blob.path])
    entry = blob.entries["exact"]

    async def main() -> None:
        reader = LayerReader(source, blobs=[LAYER], cache=cache)
        await reader.prefetch(entry, pin=True)
        assert len(source.calls) == 1
        await reader.read(blob.entries["small"], 0, 300)
        cache.evict_to(0)
        assert await reader.read(entry, 0, entry.size) == blob.contents["exact"]
        assert len(source.calls) == 2  # the prefetch and "small"; the pinned file was kept
        await reader.unpin(entry)
        cache.evict_to(0)
        assert cache.usage().chunks == 0

    trio.run(main)


def test_concurrent_readers_with_readahead_and_tiny_cache(blob: BuiltBlob, tmp_path: Path) -> None:
    """Eviction under the readers' feet (cap of 4 chunks) never yields wrong bytes."""
    cache = ChunkCache(tmp_path, 4 * CHUNK, touch_interval=0)
    source = CountingSource([blob.path], delay=0.002)
    rng = random.Random(9)
    config = ReaderConfig(readahead_bytes=3 * CHUNK, readahead_trigger=1, max_inflight_bytes=6 * CHUNK)
    bad: list[tuple[str, int, int]] = []

    async def main() -> None:
        async with open_layer_reader(source, blobs=[LAYER], cache=cache, config=config) as reader:

            async def sequential(name: str, start: int) -> None:
                e = blob.entries[name]
                for off in range(start, e.size, 40_000):
                    if await reader.read(e, off, 40_000) != blob.contents[name][off:off + 40_000]:
                        bad.append((name, off, 40_000))

            async def scattered() -> None:
                for _ in range(20):
                    name = rng.choice(["big", "exact", "small"])
                    off, size = rng.randrange(blob.entries[name].size), rng.randrange(1, 2 * CHUNK)
                    if await reader.read(blob.entries[name], off, size) != blob.contents[name][off:off + size]:
                        bad.append((name, off, size))

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(sequential, "big", i * 5 * CHUNK)
                    nursery.start_soon(sequential, "exact", 0)
                    for _ in range(4):
                        nursery.start_soon(scattered)
        assert cache.usage().bytes <= 4 * CHUNK

    trio.run(main)
    assert bad == []


def test_open_layer_reader_reraises_plain_exception(blob: BuiltBlob) -> None:
    source = CountingSource([blob.path])
    source.hang = True

    async def main() -> None:
        config = ReaderConfig(fetch_timeout=0.1)
        async with open_layer_reader(source, blobs=[LAYER], cache=None, config=config) as reader:
            await reader.read(blob.entries["small"], 0, 10)

    with pytest.raises(FetchError):
        trio.run(main)


def test_blake3_chunks_verified(tmp_path: Path) -> None:
    files = make_files(4)
    b = build_blob(tmp_path / "b3.blob", files, chunk_size=CHUNK, algo="blake3")
    assert all((c.digest or "").startswith("blake3:") for c in all_chunks(b))
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    source = CountingSource([b.path])

    async def read(name: str) -> bytes:
        reader = LayerReader(source, blobs=[LAYER], cache=cache)
        e = b.entries[name]
        return await reader.read(e, 0, e.size)

    assert trio.run(read, "big") == files["big"]
    assert cache.contains(b.entries["big"].chunks[0].digest or "")
    source.corrupt_times = 2
    with pytest.raises(DigestMismatch):
        trio.run(read, "small")
    assert not cache.contains(b.entries["small"].chunks[0].digest or "")


def test_gc_with_chunk_keys_of_live_layers(tmp_path: Path) -> None:
    live = build_blob(tmp_path / "live.blob", make_files(1), chunk_size=CHUNK, seed=1)
    dead = build_blob(tmp_path / "dead.blob", make_files(2), chunk_size=CHUNK, seed=2, digests=False)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    blobs = {"live": ["sha256:" + "c" * 64], "dead": ["sha256:" + "d" * 64]}

    async def fill() -> None:
        for name, b in (("live", live), ("dead", dead)):
            reader = LayerReader(FileRangeSource([b.path]), blobs=blobs[name], cache=cache)
            for e in b.entries.values():
                await reader.read(e, 0, e.size)

    trio.run(fill)
    # What the daemon keeps of a live layer: its chunks' keys and its read units' (grouped chunks).
    referenced = {k for e in live.entries.values() for k in cache_keys(e, blobs["live"])}
    assert any(k.startswith("group:") for k in referenced)
    removed = cache.gc(referenced)
    assert removed.chunks == len(all_chunks(dead))
    assert cache.usage().bytes == sum(len(v) for v in live.contents.values())


def test_oversized_chunk_refused_before_fetching(blob: BuiltBlob) -> None:
    from snapshotter.errors import LimitExceeded

    source = CountingSource([blob.path])
    e = blob.entries["big"]

    async def main() -> None:
        reader = LayerReader(source, blobs=[LAYER], cache=None, config=ReaderConfig(max_chunk_bytes=CHUNK // 2))
        await reader.read(e, 0, 10)

    with pytest.raises(LimitExceeded):
        trio.run(main)
    assert source.calls == []


def test_reading_three_times_the_cap_through_the_reader(blob: BuiltBlob, tmp_path: Path) -> None:
    e = blob.entries["big"]
    cap = e.size // 3
    cache = ChunkCache(tmp_path, cap, touch_interval=0)

    async def main() -> None:
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache) as reader:
            for _ in range(3):
                for off in range(0, e.size, 128 << 10):
                    assert await reader.read(e, off, 128 << 10) == blob.contents["big"][off:off + (128 << 10)]
                    assert cache.usage().bytes <= cap

    trio.run(main)
    assert 0 < cache.usage().bytes <= cap


def test_one_corrupt_chunk_in_a_merged_run_fails_alone(blob: BuiltBlob) -> None:
    e = blob.entries["exact"]  # three adjacent chunks, fetched as one run
    bad = e.chunks[1]

    class CorruptOne(CountingSource):
        async def read_range(self, blob_i: int, offset: int, length: int) -> bytes:
            data = bytearray(await super().read_range(blob_i, offset, length))
            pos = bad.blob_offset + bad.blob_size // 2 - offset
            if 0 <= pos < length:
                data[pos] ^= 0xFF
            return bytes(data)

    source = CorruptOne([blob.path], delay=0.05)
    outcome: dict[str, object] = {}

    async def whole(reader: LayerReader) -> None:
        try:
            await reader.read(e, 0, e.size)
        except DigestMismatch as exc:
            outcome["whole"] = exc

    async def last_chunk(reader: LayerReader) -> None:
        await trio.sleep(0.01)  # joins the run's flight for chunk 2 (after the bad one)
        outcome["last"] = await reader.read(e, 2 * CHUNK, 100)

    async def main() -> None:
        reader = LayerReader(source, blobs=[LAYER], cache=None, config=CHUNKWISE)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(whole, reader)
            nursery.start_soon(last_chunk, reader)

    trio.run(main)
    assert isinstance(outcome["whole"], DigestMismatch)
    assert outcome["last"] == blob.contents["exact"][2 * CHUNK:2 * CHUNK + 100]  # good chunk served
    assert len(source.calls) == 2  # the run, and one refetch of the bad chunk only


def _small_files_blob(tmp_path: Path, count: int = 40) -> BuiltBlob:
    rng = random.Random(21)
    return build_blob(tmp_path / "small.blob", {f"f{i:02d}": file_bytes(rng, rng.randint(500, 3000))
                                               for i in range(count)}, chunk_size=CHUNK)


def _read_all_in_blob_order(blob: BuiltBlob, source: CountingSource, cache: ChunkCache,
                            config: ReaderConfig) -> list[int]:
    """Read every file whole, one after another; the source's request count after each read."""
    names = sorted(blob.entries, key=lambda n: blob.entries[n].chunks[0].blob_offset)

    async def main() -> list[int]:
        after = []
        order = BlobOrder(blob.entries.values())
        async with open_layer_reader(source, blobs=[LAYER], cache=cache, config=config, order=order) as reader:
            with trio.fail_after(30):
                for name in names:
                    assert await reader.read(blob.entries[name], 0, 1 << 20) == blob.contents[name]
                    after.append(len(source.calls))
        return after

    return trio.run(main)


def test_a_burst_of_misses_fetches_the_following_files_with_them(tmp_path: Path) -> None:
    blob = _small_files_blob(tmp_path)
    source = CountingSource([blob.path])
    config = ReaderConfig(amplify_bytes=16 << 10, readahead_bytes=0)
    requests = _read_all_in_blob_order(blob, source, ChunkCache(tmp_path / "cache", 1 << 30), config)
    free = AMPLIFY_FREE_MISSES
    # The first misses of a burst fetch only themselves: a short start pays nothing extra.
    assert requests[:free] == list(range(1, free + 1))
    # Then each miss brings the files stored after it: the next ones are cache hits.
    assert requests[free] == free + 1 and requests[free + 1] == free + 1
    assert requests[-1] < len(blob.entries) / 2
    # No request is longer than a miss plus the window; no chunk is fetched twice.
    assert max(n for _, _, n in source.calls) <= (16 << 10) + max(c.blob_size for c in all_chunks(blob))
    assert max(source.fetches_per_chunk(all_chunks(blob)).values()) == 1


def test_no_amplification_when_off_or_without_blob_order(tmp_path: Path) -> None:
    blob = _small_files_blob(tmp_path, count=AMPLIFY_FREE_MISSES + 6)
    source = CountingSource([blob.path])
    off = ReaderConfig(amplify_bytes=0, readahead_bytes=0)
    assert _read_all_in_blob_order(blob, source, ChunkCache(tmp_path / "c1", 1 << 30), off)[-1] == len(blob.entries)

    async def without_order() -> int:
        reader = LayerReader(CountingSource([blob.path]), blobs=[LAYER], cache=ChunkCache(tmp_path / "c2", 1 << 30),
                             config=ReaderConfig(amplify_bytes=1 << 20))
        for entry in blob.entries.values():
            await reader.read(entry, 0, 1 << 20)
        return reader.stats.amplified_chunks

    assert trio.run(without_order) == 0


def test_amplification_stops_at_a_cached_chunk(tmp_path: Path) -> None:
    blob = _small_files_blob(tmp_path, count=AMPLIFY_FREE_MISSES + 12)
    names = sorted(blob.entries, key=lambda n: blob.entries[n].chunks[0].blob_offset)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    cached = names[AMPLIFY_FREE_MISSES + 3]
    cache.put(chunk_key(blob.entries[cached].chunks[0], [LAYER]), blob.contents[cached])
    source = CountingSource([blob.path])
    config = ReaderConfig(amplify_bytes=1 << 20, readahead_bytes=0)
    requests = _read_all_in_blob_order(blob, source, cache, config)
    # The first amplified miss brought the two files before the cached one, and stopped there:
    # the cached file is not fetched again, the one after it is a miss of its own.
    amplified = AMPLIFY_FREE_MISSES
    assert requests[amplified] == requests[amplified + 2] == requests[amplified + 3] == amplified + 1
    assert requests[amplified + 4] == amplified + 2
    assert source.fetches_per_chunk(blob.entries[cached].chunks)[blob.entries[cached].chunks[0].blob_offset] == 0



def test_amplification_stops_at_a_chunk_another_loop_is_fetching(tmp_path: Path) -> None:
    """A chunk claimed in the shared flights (the spare's early prefetch has it in flight) ends
    the window as a cached one does: the read must not wait for that fetch to reach it."""
    from snapshotter.reader.shared_flights import SharedFlights

    blob = _small_files_blob(tmp_path, count=AMPLIFY_FREE_MISSES + 12)
    names = sorted(blob.entries, key=lambda n: blob.entries[n].chunks[0].blob_offset)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    claimed = blob.entries[names[AMPLIFY_FREE_MISSES + 3]].chunks[0]
    flights = SharedFlights()
    flights.claim(str(cache.root), [chunk_key(claimed, [LAYER])], object())  # another loop's, never released
    source = CountingSource([blob.path])
    config = ReaderConfig(amplify_bytes=1 << 20, readahead_bytes=0, fetch_timeout=3)

    async def main() -> list[int]:
        after = []
        reader = LayerReader(source, blobs=[LAYER], cache=cache, config=config, order=BlobOrder(blob.entries.values()),
                             shared=flights)
        with trio.fail_after(10):
            for name in names[:AMPLIFY_FREE_MISSES + 3]:  # up to the file before the claimed one
                assert await reader.read(blob.entries[name], 0, 1 << 20) == blob.contents[name]
                after.append(len(source.calls))
        return after

    requests = trio.run(main)
    amplified = AMPLIFY_FREE_MISSES
    assert requests[amplified] == requests[amplified + 2] == amplified + 1  # its two neighbours came along
    assert source.fetches_per_chunk([claimed])[claimed.blob_offset] == 0  # the claimed one did not


@pytest.mark.parametrize(("verify", "thread_reads"), [(False, 1), (True, 5)])
def test_reads_of_page_cached_chunks_are_served_inline(blob: BuiltBlob, tmp_path: Path, verify: bool,
                                                       thread_reads: int) -> None:
    """After a chunk's file is open, reads of it come from the page cache without the worker
    thread (`ChunkCache.get`); verify_cached reads always go through the checked path."""
    entry = blob.entries["big"]
    cache = ChunkCache(tmp_path, 1 << 30)
    gets: list[str] = []
    real_get = cache.get

    def counting_get(key: str, offset: int = 0, size: int | None = None) -> bytes | None:
        gets.append(key)
        return real_get(key, offset, size)

    async def main() -> None:
        reader = LayerReader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                             config=ReaderConfig(verify_cached=verify))
        await reader.prefetch(entry)
        cache.get = counting_get  # type: ignore[method-assign]
        for off in range(0, 5 * 4096, 4096):  # five reads inside the first chunk
            assert await reader.read(entry, off, 4096) == blob.contents["big"][off:off + 4096]

    trio.run(main)
    assert len(gets) == thread_reads


def test_streamed_fetches_hold_neither_the_answer_nor_a_whole_chunk(tmp_path: Path) -> None:
    """Reading a file of 4 MiB chunks cold (read-ahead on): the reader's Python allocations
    peak at a small part of one chunk, not at the compressed + uncompressed chunks in flight."""
    import os
    import tracemalloc

    chunk_size = 4 << 20
    content = os.urandom(3 * chunk_size)
    b = build_blob(tmp_path / "big.blob", {"big": content}, chunk_size=chunk_size)
    entry = b.entries["big"]
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    digest = hashlib.sha256()

    async def main() -> None:
        with trio.fail_after(60):
            async with open_layer_reader(FileRangeSource([b.path]), blobs=[LAYER], cache=cache,
                                         config=ReaderConfig(max_merge_bytes=8 << 20)) as reader:
                for off in range(0, entry.size, 1 << 20):
                    digest.update(await reader.read(entry, off, 1 << 20))

    tracemalloc.start()
    try:
        trio.run(main)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digest.digest() == hashlib.sha256(content).digest()
    assert peak < chunk_size, f"peak {peak} bytes"


def _chunk_only_in_page_cache(cache: ChunkCache, key: str, size: int) -> None:
    """Drop the page cache, then bring back only `key`'s file (held open by the cache)."""
    if os.geteuid() != 0:
        pytest.fail("needs root to drop the page cache (the project runs tests as root)")
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")
    assert cache.get(key, 0, size) is not None


def test_a_read_that_catches_up_with_the_disk_finishes_in_its_one_buffer(blob: BuiltBlob, tmp_path: Path) -> None:
    """A warm sequential reader ahead of the read-ahead: the first chunk of its read is in the
    page cache, the next is still on disk. The rest of the read goes into the same buffer from a
    worker thread; it is not read again part by part (a second read of the first part and a join)."""
    cache = ChunkCache(tmp_path, 1 << 30, touch_interval=3600)
    entry = blob.entries["big"]
    want = blob.contents["big"]
    first, second = entry.chunks[2], entry.chunks[3]

    async def main() -> None:
        async with open_layer_reader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                                     config=ReaderConfig(readahead_bytes=0)) as reader:
            assert await reader.read(entry, 0, entry.size) == want  # everything cached
            _chunk_only_in_page_cache(cache, reader.key_for(first), first.size)

            def no(*args: object) -> None:
                raise AssertionError("read piece by piece")

            cache.get_resident = no  # type: ignore[method-assign]
            cache.get = no  # type: ignore[method-assign]
            hits = reader.stats.cache_hits
            lo, hi = first.file_offset + 100, second.file_offset + 5000
            assert await reader.read(entry, lo, hi - lo) == want[lo:hi]
            assert reader.stats.cache_hits == hits + 2

    trio.run(main)


def test_a_joined_read_whose_later_chunk_is_gone_is_fetched_again(blob: BuiltBlob, tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30, touch_interval=3600)
    entry = blob.entries["big"]
    want = blob.contents["big"]
    first, second = entry.chunks[5], entry.chunks[6]
    source = CountingSource([blob.path])

    async def main() -> None:
        async with open_layer_reader(source, blobs=[LAYER], cache=cache,
                                     config=ReaderConfig(readahead_bytes=0)) as reader:
            assert await reader.read(entry, 0, entry.size) == want
            _chunk_only_in_page_cache(cache, reader.key_for(first), first.size)
            assert cache.discard(reader.key_for(second))  # evicted by another process meanwhile
            source.calls.clear()
            lo, hi = first.file_offset + 100, second.file_offset + 5000
            assert await reader.read(entry, lo, hi - lo) == want[lo:hi]
            assert [(off, length) for _, off, length in source.calls] == [(second.blob_offset, second.blob_size)]

    trio.run(main)


def test_a_read_gets_its_bytes_when_the_cache_loses_every_chunk_it_reports(blob: BuiltBlob, tmp_path: Path) -> None:
    # The cache reports every chunk present (as when another read's flight has just stored it)
    # but has lost each by the time it is read back (evicted by a cache far too small). The last
    # round must fetch the bytes itself instead of trusting the cache once more.
    class Forgetful(ChunkCache):
        def present(self, keys: Iterable[str]) -> set[str]:
            return set(keys)

        def get(self, key: str, offset: int = 0, size: int | None = None) -> bytes | None:
            return None

        def get_resident(self, key: str, offset: int, size: int) -> bytearray | None:
            return None

        def read_resident_into(self, key: str, offset: int, into: memoryview) -> bool:
            return False

        def read_into(self, key: str, offset: int, into: memoryview) -> bool:
            return False

    e = blob.entries["big"]
    source = CountingSource([blob.path])

    async def main() -> bytes | bytearray:
        reader = LayerReader(source, blobs=[LAYER], cache=Forgetful(tmp_path, 1 << 30), config=CHUNKWISE)
        return await reader.read(e, CHUNK, 200)

    assert trio.run(main) == blob.contents["big"][CHUNK:CHUNK + 200]
    assert source.calls, "the bytes came from the source"
