"""Cache keys of a layer's chunks and read units: what a reader stores a file's bytes under, and
what the daemon keeps of a live layer when it collects garbage (without the reader itself)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from snapshotter.cache.keys import blob_key, file_key, group_key, is_digest_key
from snapshotter.errors import FormatError
from snapshotter.formats.index import Chunk, Entry
from snapshotter.reader.units import UNIT_BYTES, ChunkGroup, units


def chunk_key(chunk: Chunk, blobs: Sequence[str]) -> str:
    """The cache key of a chunk: its digest (lowercased), or, for formats that record none, its
    position in its blob (`blobs[chunk.blob_index]`, as in `LayerIndex.blobs`).

    A read unit of several chunks (ChunkGroup) is keyed by its parts' digests (`group_key`).
    The daemon lists the keys live snapshots reference for `ChunkCache.gc` with `cache_keys`.
    FormatError for digests the cache cannot address (algorithms other than sha256/blake3).
    """
    if isinstance(chunk, ChunkGroup):
        return group_key(chunk_key(p, blobs) for p in chunk.parts)
    if chunk.digest is not None:
        d = chunk.digest
        key = d if d.islower() else d.lower()  # most are lowercase already: no copy of each
        if not is_digest_key(key):
            raise FormatError(f"chunk at blob offset {chunk.blob_offset}: unsupported digest {chunk.digest!r}")
        return key
    try:
        blob = blobs[chunk.blob_index]
    except IndexError:
        raise FormatError(f"chunk refers to blob number {chunk.blob_index} of {len(blobs)}") from None
    return blob_key(blob, chunk.blob_offset, chunk.inner_offset, chunk.size)


def whole_file_key(entry: Entry, blobs: Sequence[str]) -> str | None:
    """The key of the whole of a regular file of several chunks (cache/keys.py `file_key`), which
    fusefs/direct.py stores once all of them are cached; None for a file of one chunk or none
    (its chunk is the whole file). FormatError as `chunk_key`."""
    if len(entry.chunks) < 2:
        return None
    return file_key(f"zeros:{c.size}" if c.zeros else chunk_key(c, blobs) for c in entry.chunks)


def cache_keys(entry: Entry, blobs: Sequence[str], unit_bytes: int = UNIT_BYTES) -> Iterator[str]:
    """Every key a reader may cache a regular file's bytes under: its chunks' keys, where small
    chunks are grouped into read units (reader/units.py; `unit_bytes` as the readers') the
    units' keys, and the key of the whole file (`whole_file_key`). What the daemon keeps of a
    live layer when it collects garbage."""
    for c in entry.chunks:
        yield chunk_key(c, blobs)
    if len(entry.chunks) > 1:
        for u in units(entry, unit_bytes):
            if isinstance(u, ChunkGroup):
                yield chunk_key(u, blobs)
        whole = whole_file_key(entry, blobs)
        assert whole is not None
        yield whole
