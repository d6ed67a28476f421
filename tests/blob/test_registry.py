"""LayerReader through the real registry client against a real `docker-registry` on 127.0.0.1."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from snapshotter.cache import ChunkCache
from snapshotter.errors import FetchError
from snapshotter.fetch import FetchConfig, RegistryClient
from snapshotter.reader import BlobOrder, LayerReader, ReaderConfig, RegistryRangeSource, open_layer_reader
from snapshotter.reader.units import units_for
from tests.blob.blobs import build_blob, file_bytes
from tests.fetch.registry import RegistryProcess, push_blob

FAST = FetchConfig(retries=1, backoff_initial=0.01, backoff_max=0.05, connect_timeout=2.0,
                   read_timeout=5.0, request_timeout=15.0)


def test_reads_through_registry_client(registry: RegistryProcess, tmp_path: Path) -> None:
    rng = random.Random(11)
    files = {"a": file_bytes(rng, 3_000_000), "b": file_bytes(rng, 1000)}
    built = build_blob(tmp_path / "l.blob", files, chunk_size=256 << 10)
    digest = push_blob(registry.url, "test/blob", built.path.read_bytes())
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    rng2 = random.Random(3)
    reads = [(n, rng2.randrange(len(files[n])), rng2.randrange(1, 600_000)) for n in ("a", "b") for _ in range(30)]

    async def main() -> tuple[dict[int, bytes], int]:
        async with RegistryClient(FAST) as client:
            source = RegistryRangeSource(client, f"{registry.host}/test/blob", [digest])
            reader = LayerReader(source, blobs=[digest], cache=cache)
            out: dict[int, bytes] = {}

            async def one(i: int, name: str, off: int, size: int) -> None:
                out[i] = await reader.read(built.entries[name], off, size)

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for i, r in enumerate(reads):
                        nursery.start_soon(one, i, *r)
            return out, reader.stats.chunks_fetched

    out, fetched = trio.run(main)
    for i, (name, off, size) in enumerate(reads):
        assert out[i] == files[name][off:off + size]
    touched = {c.blob_offset for name, off, size in reads for c in units_for(built.entries[name], off, size)}
    assert fetched == len(touched)  # each needed read unit (small chunks grouped) fetched exactly once


def test_missing_blob_is_fetch_error(registry: RegistryProcess, tmp_path: Path) -> None:
    built = build_blob(tmp_path / "m.blob", {"f": b"x" * 1000}, chunk_size=4096)
    absent = "sha256:" + "0" * 64

    async def main() -> None:
        async with RegistryClient(FAST) as client:
            source = RegistryRangeSource(client, f"{registry.host}/test/blob", [absent])
            reader = LayerReader(source, blobs=[absent], cache=None, config=ReaderConfig(fetch_timeout=20))
            await reader.read(built.entries["f"], 0, 1000)

    with pytest.raises(FetchError):
        trio.run(main)


def test_amplified_misses_through_the_registry(registry: RegistryProcess, tmp_path: Path) -> None:
    """A burst of small-file misses against the real registry: the amplified range requests
    bring the following files, which then read from the cache; every byte is right."""
    rng = random.Random(5)
    files = {f"m{i:03d}": file_bytes(rng, rng.randint(200, 4000)) for i in range(60)}
    built = build_blob(tmp_path / "s.blob", files, chunk_size=64 << 10)
    digest = push_blob(registry.url, "test/small", built.path.read_bytes())

    async def main() -> tuple[int, int]:
        async with RegistryClient(FAST) as client:
            source = RegistryRangeSource(client, f"{registry.host}/test/small", [digest])
            async with open_layer_reader(source, blobs=[digest], cache=ChunkCache(tmp_path / "cache", 1 << 30),
                                         config=ReaderConfig(amplify_bytes=256 << 10, readahead_bytes=0),
                                         order=BlobOrder(built.entries.values())) as reader:
                with trio.fail_after(60):
                    for name, content in files.items():  # dict order is blob order
                        assert await reader.read(built.entries[name], 0, 1 << 20) == content
                return reader.stats.requests, reader.stats.amplified_chunks

    requests, amplified = trio.run(main)
    assert requests < len(files) // 4, requests
    assert amplified >= len(files) - requests


def test_a_broken_answer_starts_the_stream_over_and_leaves_no_temp_file(registry: RegistryProcess,
                                                                        tmp_path: Path) -> None:
    """The registry's answer breaks off halfway (a proxy resets the connection): the client asks
    again, the reader's decoding of that range starts over, the bytes are right, and the cache
    holds the chunks and no temp file of the broken attempt."""
    from tests.cache.helpers import temp_files
    from tests.fetch.proxies import Fault, RegistryProxy

    rng = random.Random(21)
    content = file_bytes(rng, 2_000_000)
    built = build_blob(tmp_path / "r.blob", {"f": content}, chunk_size=256 << 10)
    digest = push_blob(registry.url, "test/reset", built.path.read_bytes())
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    entry = built.entries["f"]
    with RegistryProxy(registry.url) as proxy:
        proxy.add_fault(Fault("reset"))

        async def main() -> bytes:
            async with RegistryClient(FAST) as client:
                source = RegistryRangeSource(client, f"{proxy.host}/test/reset", [digest])
                reader = LayerReader(source, blobs=[digest], cache=cache, config=ReaderConfig(max_merge_bytes=4 << 20))
                with trio.fail_after(60):
                    return await reader.read(entry, 0, entry.size)

        assert trio.run(main) == content
        assert len(proxy.blob_requests()) == 2  # the broken answer and the retry
    assert temp_files(tmp_path / "cache") == []
    assert cache.usage().chunks == len(entry.chunks)


def test_a_fetch_that_times_out_mid_stream_leaves_nothing_behind(tmp_path: Path) -> None:
    """A source that stops sending halfway: the read fails after fetch_timeout, naming the
    range, and neither a temp file nor a chunk of the unfinished range stays in the cache."""
    from snapshotter.reader import FileRangeSource
    from snapshotter.reader.source import RangeSink
    from tests.cache.helpers import temp_files

    built = build_blob(tmp_path / "t.blob", {"f": file_bytes(random.Random(2), 1_500_000)}, chunk_size=1 << 20)
    entry = built.entries["f"]

    class Stalls(FileRangeSource):
        async def stream_range(self, blob: int, offset: int, length: int, sink: RangeSink) -> None:
            data = await self.read_range(blob, offset, length)
            await sink.write(data[:len(data) // 2])
            await trio.sleep_forever()

    cache = ChunkCache(tmp_path / "cache", 1 << 30)

    async def main() -> None:
        reader = LayerReader(Stalls([built.path]), blobs=["sha256:" + "1" * 64], cache=cache,
                             config=ReaderConfig(fetch_timeout=0.5))
        with trio.fail_after(30):
            await reader.read(entry, 0, entry.size)

    with pytest.raises(FetchError, match="not fetched within"):
        trio.run(main)
    assert temp_files(tmp_path / "cache") == [] and cache.usage().chunks == 0
