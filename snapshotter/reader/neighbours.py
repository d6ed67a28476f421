"""A layer's chunks in blob order, to find the chunks stored right after a chunk. Pure: no IO.

A container's first reads are mostly whole small files, one after another, and a layer stores
the files of one directory next to each other (tar order). So when a read misses, the chunks
that follow it in the blob are likely the next misses: fetching them in the same range request
(read amplification, as Nydus's `amplify_io`) turns a chain of round trips into one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from snapshotter.formats.index import Chunk, Entry, EntryType
from snapshotter.reader.units import UNIT_BYTES, units

_BLOB_SHIFT = 48  # position key: blob number above, blob offset below (blobs stay under 256 TiB)


def _position(chunk: Chunk) -> int:
    return (chunk.blob_index << _BLOB_SHIFT) | chunk.blob_offset


class BlobOrder:
    """The read units (reader/units.py, `unit_bytes` as the reader's) of one layer's regular
    files sorted by (blob, blob offset).

    Built on the first `following` call (a mount that never misses never pays for it). Units
    of all-zero content are left out (they are never fetched); a unit listed by several
    entries appears once.
    """

    def __init__(self, entries: Iterable[Entry], unit_bytes: int = UNIT_BYTES) -> None:
        self._entries: Iterable[Entry] | None = entries
        self._unit_bytes = unit_bytes
        self._chunks: list[Chunk] = []
        self._positions: list[int] = []

    def _build(self) -> None:
        assert self._entries is not None
        seen: set[tuple[int, int, int, int]] = set()
        chunks = []
        for entry in self._entries:
            if entry.type is not EntryType.REG:
                continue
            for c in units(entry, self._unit_bytes):
                where = (c.blob_index, c.blob_offset, c.inner_offset, c.size)
                if not c.zeros and where not in seen:
                    seen.add(where)
                    chunks.append(c)
        chunks.sort(key=lambda c: (c.blob_index, c.blob_offset, c.inner_offset))
        self._chunks = chunks
        self._positions = [_position(c) for c in chunks]
        self._entries = None

    def following(self, chunk: Chunk, *, max_bytes: int, max_gap: int) -> list[Chunk]:
        """Chunks of `chunk`'s blob stored after it (or in the same compressed member), in blob
        order, while each starts at most `max_gap` bytes after the previous one ends and all of
        them end at most `max_bytes` bytes after `chunk` ends. Empty when `max_bytes` <= 0."""
        if max_bytes <= 0:
            return []
        if self._entries is not None:
            self._build()
        end = chunk.blob_offset + chunk.blob_size
        limit = end + max_bytes
        out: list[Chunk] = []
        # From the first chunk at the same offset: chunks sharing its compressed member come free.
        for i in range(bisect_left(self._positions, _position(chunk)), len(self._chunks)):
            c = self._chunks[i]
            c_end = c.blob_offset + c.blob_size
            if c.blob_index != chunk.blob_index or c.blob_offset - end > max_gap or c_end > limit:
                break
            if c.blob_offset != chunk.blob_offset or c.inner_offset != chunk.inner_offset:
                out.append(c)
            end = max(end, c_end)
        return out
