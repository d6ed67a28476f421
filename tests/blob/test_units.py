"""Read units (reader/units.py): which chunks are grouped, that every view of a file agrees on
the groups, that a group decodes to its parts' bytes and checks each part's digest, and that a
reader fetches and caches a group as one piece."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.cache import ChunkCache
from snapshotter.cache.keys import group_key
from snapshotter.errors import DigestMismatch
from snapshotter.formats.digest import compute_digest
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType
from snapshotter.reader import FileRangeSource, LayerReader, ReaderConfig, cache_keys, chunk_key
from snapshotter.reader.source import RangeSink
from snapshotter.reader.units import ChunkGroup, UnitDecoder, decode_unit, group_chunks, units, units_for

MiB = 1 << 20
BLOB = "sha256:" + "a" * 64


def _chunk(file_offset: int, size: int, blob_offset: int, blob_size: int | None = None, **kw: object) -> Chunk:
    fields: dict = dict(compression=Compression.ZSTD, digest="sha256:" + "0" * 64)
    fields.update(kw)
    return Chunk(file_offset=file_offset, size=size, blob_offset=blob_offset,
                 blob_size=size // 2 if blob_size is None else blob_size, **fields)


def _back_to_back(sizes: list[int]) -> list[Chunk]:
    out, f, b = [], 0, 0
    for s in sizes:
        out.append(_chunk(f, s, b))
        f, b = f + s, b + s // 2
    return out


def _spans(units_: list[Chunk]) -> list[tuple[int, int]]:
    return [(u.file_offset, u.end) for u in units_]


def test_nydus_sized_chunks_group_into_window_aligned_units() -> None:
    chunks = _back_to_back([MiB] * 10)
    got = group_chunks(chunks, 4 * MiB)
    assert _spans(got) == [(0, 4 * MiB), (4 * MiB, 8 * MiB), (8 * MiB, 10 * MiB)]
    first = got[0]
    assert isinstance(first, ChunkGroup) and first.parts == tuple(chunks[:4])
    assert (first.blob_offset, first.blob_size, first.digest) == (0, 2 * MiB, None)
    assert chunk_key(first, [BLOB]) == group_key([c.digest or "" for c in chunks[:4]])
    assert chunk_key(first, [BLOB]).startswith("group:")


@pytest.mark.parametrize("odd", [
    dict(inner_offset=7), dict(zeros=True), dict(digest=None), dict(compression=Compression.NONE),
    dict(blob_index=1), dict(blob_offset=10 * MiB),  # stored elsewhere (a deduplicated chunk)
])
def test_a_chunk_that_does_not_continue_the_run_breaks_it(odd: dict) -> None:
    chunks = _back_to_back([MiB] * 3)
    chunks[1] = _chunk(MiB, MiB, odd.pop("blob_offset", MiB // 2), **odd)
    got = group_chunks(chunks, 4 * MiB)
    assert got == chunks, "no two of these may share a unit"


def test_big_chunks_and_single_chunk_files_stay_as_they_are() -> None:
    big = _back_to_back([4 * MiB, 4 * MiB, MiB])
    assert group_chunks(big, 4 * MiB) == big
    one = Entry(name="f", type=EntryType.REG, size=100, chunks=(_chunk(0, 100, 0),))
    assert units(one) is one.chunks


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 3 * MiB), min_size=1, max_size=24),
       breaks=st.sets(st.integers(0, 23)), unit=st.sampled_from([64 << 10, MiB, 4 * MiB]),
       reads=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 9 * MiB)), max_size=6))
def test_every_range_sees_the_units_of_the_whole_file(sizes: list[int], breaks: set[int], unit: int,
                                                       reads: list[tuple[float, int]]) -> None:
    """Reads, prefetch and garbage collection must agree on the units, whatever range asks."""
    chunks = _back_to_back(sizes)
    for i in breaks & set(range(1, len(chunks))):  # stored apart from the chunk before it
        c = chunks[i]
        chunks[i] = _chunk(c.file_offset, c.size, c.blob_offset + 1)
        for j in range(i + 1, len(chunks)):
            chunks[j] = _chunk(chunks[j].file_offset, chunks[j].size, chunks[j].blob_offset + 1)
    entry = Entry(name="f", type=EntryType.REG, size=chunks[-1].end, chunks=tuple(chunks))
    whole = list(units(entry, unit))
    assert [p for u in whole for p in (u.parts if isinstance(u, ChunkGroup) else (u,))] == chunks
    assert all(u.size <= unit for u in whole if isinstance(u, ChunkGroup))
    for frac, size in reads:
        offset = int(frac * (entry.size - 1))
        want = [u for u in whole if u.end > offset and u.file_offset < offset + size]
        assert list(units_for(entry, offset, size, unit)) == want


def _zstd_parts(rng: random.Random, sizes: list[int]) -> tuple[list[Chunk], bytes, bytes]:
    """Chunks of independently compressed zstd frames stored back to back: (chunks, blob, plain)."""
    chunks, blob, plain = [], bytearray(), bytearray()
    for size in sizes:
        data = rng.randbytes(size // 2) + bytes(size - size // 2)
        frame = zstandard.ZstdCompressor().compress(data)
        chunks.append(Chunk(file_offset=len(plain), size=size, blob_offset=len(blob), blob_size=len(frame),
                            compression=Compression.ZSTD, digest=compute_digest("sha256", data)))
        blob += frame
        plain += data
    return chunks, bytes(blob), bytes(plain)


def test_a_group_decodes_to_its_parts_in_any_pieces() -> None:
    rng = random.Random(3)
    chunks, blob, plain = _zstd_parts(rng, [70_000, 65_536, 1000])
    (group,) = group_chunks(chunks, 256 << 10)
    assert isinstance(group, ChunkGroup)
    assert decode_unit(group, blob) == plain
    pieces: list[bytes] = []
    decoder = UnitDecoder(group, pieces.append, max_piece=4096)
    pos = 0
    while pos < len(blob):
        step = rng.randint(1, 9000)
        decoder.feed(blob[pos:pos + step])
        pos += step
    decoder.finish()
    assert b"".join(pieces) == plain and max(map(len, pieces)) <= 4096


def test_a_bad_part_is_a_digest_mismatch_naming_it() -> None:
    chunks, blob, _ = _zstd_parts(random.Random(4), [50_000, 50_000, 50_000])
    (group,) = group_chunks(chunks, 256 << 10)
    wrong = Chunk(**{**{f: getattr(chunks[1], f) for f in Chunk.__dataclass_fields__},
                     "digest": "sha256:" + "f" * 64})
    (bad_digest,) = group_chunks([chunks[0], wrong, chunks[2]], 256 << 10)
    with pytest.raises(DigestMismatch, match=f"part at blob offset {chunks[1].blob_offset}"):
        decode_unit(bad_digest, blob)
    flipped = bytearray(blob)
    flipped[chunks[2].blob_offset + 6] ^= 0xFF
    with pytest.raises(DigestMismatch, match=f"part at blob offset {chunks[2].blob_offset}"):
        decode_unit(group, bytes(flipped))
    with pytest.raises(DigestMismatch, match="bytes ended"):
        decode_unit(group, blob[:-10])


class _Counting(FileRangeSource):
    def __init__(self, path: Path) -> None:
        super().__init__([path])
        self.calls: list[tuple[int, int]] = []
        self.corrupt = 0

    async def read_range(self, blob: int, offset: int, length: int) -> bytes:
        self.calls.append((offset, length))
        data = await super().read_range(blob, offset, length)
        if self.corrupt:
            self.corrupt -= 1
            data = data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]
        return data

    async def stream_range(self, blob: int, offset: int, length: int, sink: RangeSink) -> None:
        """The same answer to a streaming reader, in uneven pieces (parts end mid-piece)."""
        view = memoryview(await self.read_range(blob, offset, length))
        for pos in range(0, length, 40_000):
            await sink.write(view[pos:pos + 40_000])


def test_reader_fetches_and_caches_a_group_as_one_piece(tmp_path: Path) -> None:
    unit = 256 << 10
    chunks, blob, plain = _zstd_parts(random.Random(5), [64 << 10] * 10)  # 640 KiB: units of 4, 4, 2
    (tmp_path / "blob").write_bytes(blob)
    entry = Entry(name="f", type=EntryType.REG, size=len(plain), chunks=tuple(chunks))
    source = _Counting(tmp_path / "blob")
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    config = ReaderConfig(unit_bytes=unit, max_merge_bytes=1)  # one request per unit

    async def read_all() -> bytes:
        reader = LayerReader(source, blobs=[BLOB], cache=cache, config=config)
        out = bytearray()
        for off in range(0, entry.size, 48 << 10):
            out += await reader.read(entry, off, 48 << 10)
        return bytes(out)

    try:
        source.corrupt = 1  # the first answer is bad once: fetched again, never cached bad
        assert trio.run(read_all) == plain
        groups = group_chunks(chunks, unit)
        assert len(groups) == 3
        assert [length for _, length in source.calls] == [groups[0].blob_size] * 2 + [g.blob_size for g in groups[1:]]
        keys = {chunk_key(g, [BLOB]) for g in groups}
        assert cache.usage().chunks == 3 and cache.present(keys) == keys
        assert keys <= set(cache_keys(entry, [BLOB], unit)), "garbage collection keeps what reads cached"
        source.calls.clear()
        assert trio.run(read_all) == plain and source.calls == [], "warm: all from the cache"
        source.corrupt = 2
        cache.discard(chunk_key(groups[1], [BLOB]))
        with pytest.raises(DigestMismatch):
            trio.run(read_all)
        assert not cache.contains(chunk_key(groups[1], [BLOB]))
    finally:
        cache.close()


def test_a_file_grouped_alike_in_two_layers_is_cached_once(tmp_path: Path) -> None:
    """Group keys are made of the parts' digests: the same file stored at another offset of
    another blob maps to the same cache files."""
    unit = 256 << 10
    chunks, blob, plain = _zstd_parts(random.Random(6), [64 << 10] * 6)
    lead = zstandard.ZstdCompressor().compress(b"another layer's files first")
    (tmp_path / "a").write_bytes(blob)
    (tmp_path / "b").write_bytes(lead + blob)
    moved = [Chunk(**{**{f: getattr(c, f) for f in Chunk.__dataclass_fields__},
                      "blob_offset": c.blob_offset + len(lead)}) for c in chunks]
    in_a = Entry(name="f", type=EntryType.REG, size=len(plain), chunks=tuple(chunks))
    in_b = Entry(name="g", type=EntryType.REG, size=len(plain), chunks=tuple(moved))
    source_b = _Counting(tmp_path / "b")
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    config = ReaderConfig(unit_bytes=unit)

    async def main() -> None:
        a = LayerReader(FileRangeSource([tmp_path / "a"]), blobs=["sha256:" + "a" * 64], cache=cache, config=config)
        b = LayerReader(source_b, blobs=["sha256:" + "b" * 64], cache=cache, config=config)
        assert await a.read(in_a, 0, in_a.size) == plain
        used = cache.usage()
        assert used.chunks == 2 and used.bytes == len(plain)
        assert await b.read(in_b, 0, in_b.size) == plain
        assert cache.usage() == used

    try:
        trio.run(main)
    finally:
        cache.close()
    assert source_b.calls == []
