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
    touched = {c.blob_offset for name, off, size in reads for c in built.entries[name].chunks_for(off, size)}
    assert fetched == len(touched)  # each needed chunk fetched exactly once


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
