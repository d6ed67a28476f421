"""Read units: the pieces a reader fetches, verifies and caches, grouping a format's small chunks.

The chunk cache keeps one file per cached piece, and a warm read of 1 MiB files (Nydus's
default chunk size) costs the kernel about twice the system time of 4 MiB files: per-file
read-ahead and lookup work (docs/operations.md, "Small chunks are read ... in units"). So a reader treats a file's
consecutive small chunks that are stored back to back in a blob as one `ChunkGroup`: one range,
one cache file, each part still checked against its own digest. Pure: no IO.

The grouping rule is local and deterministic, so a read of any range, a prefetch of a whole
file and the cache's garbage collection all see the same units:
- The file is cut into windows of `unit_bytes` file bytes; a chunk belongs to the window its
  first byte lies in.
- Within a window, a run of consecutive chunks forms one group while each next chunk starts
  where the previous one ends, in the file and in the same blob (compressed), with the same
  compression, and the run's bytes stay within `unit_bytes`.
- Only chunks with a digest, no inner offset and real content (not `zeros`) are grouped. Any
  other chunk, and a run of one, is its own unit: the format's chunk object itself.

A group has no digest of its own: its cache key is made of its parts' digests (`chunk_key`
makes "group:HEX" of it, cache/keys.py), so a file chunked alike in two layers is cached once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from snapshotter.errors import DigestMismatch, FormatError
from snapshotter.formats.codec import DEFAULT_PIECE, Buffer, ChunkDecoder
from snapshotter.formats.digest import DigestCheck
from snapshotter.formats.index import Chunk, Entry

# 4 MiB: the size of our eStargz's chunks, which read warm at the speed the benchmark asks for (a
# Nydus image converted with 4 MiB chunks read as fast as eStargz; with 1 MiB ones it took 37% longer).
UNIT_BYTES = 4 << 20


@dataclass(slots=True, unsafe_hash=True)
class ChunkGroup(Chunk):
    """Chunks of one file stored back to back in one blob, read as one chunk.

    The inherited fields span the parts: file range [file_offset, end), compressed range
    [blob_offset, blob_offset + blob_size); `digest` is None (each part has its own)."""

    parts: tuple[Chunk, ...] = ()


def is_verified(chunk: Chunk) -> bool:
    """Whether the chunk's bytes are checked against a digest (its own or its parts')."""
    return chunk.digest is not None or isinstance(chunk, ChunkGroup)


def _groupable(c: Chunk, unit_bytes: int) -> bool:
    return c.digest is not None and not c.zeros and c.inner_offset == 0 and c.size < unit_bytes


def _group_of(run: list[Chunk]) -> Chunk:
    if len(run) == 1:
        return run[0]
    first, last = run[0], run[-1]
    return ChunkGroup(file_offset=first.file_offset, size=last.end - first.file_offset,
                      blob_offset=first.blob_offset, blob_size=last.blob_offset + last.blob_size - first.blob_offset,
                      compression=first.compression, digest=None, blob_index=first.blob_index, parts=tuple(run))


def group_chunks(chunks: Sequence[Chunk], unit_bytes: int = UNIT_BYTES) -> list[Chunk]:
    """The units of `chunks` (consecutive chunks of one file, from the start of a window:
    see the module docstring), in file order."""
    out: list[Chunk] = []
    run: list[Chunk] = []
    run_bytes = 0
    for c in chunks:
        if run:
            prev = run[-1]
            if (prev.end == c.file_offset and prev.blob_index == c.blob_index
                    and prev.blob_offset + prev.blob_size == c.blob_offset and prev.compression is c.compression
                    and run[0].file_offset // unit_bytes == c.file_offset // unit_bytes
                    and run_bytes + c.size <= unit_bytes and _groupable(c, unit_bytes)):
                run.append(c)
                run_bytes += c.size
                continue
            out.append(_group_of(run))
            run = []
        if _groupable(c, unit_bytes):
            run, run_bytes = [c], c.size
        else:
            out.append(c)
    if run:
        out.append(_group_of(run))
    return out


def units(entry: Entry, unit_bytes: int = UNIT_BYTES) -> Sequence[Chunk]:
    """Every unit of a regular file, in file order (its chunks when unit_bytes <= 0)."""
    if unit_bytes <= 0 or len(entry.chunks) < 2:
        return entry.chunks
    return group_chunks(entry.chunks, unit_bytes)


def units_for(entry: Entry, offset: int, size: int, unit_bytes: int = UNIT_BYTES) -> Sequence[Chunk]:
    """The units covering file bytes [offset, offset+size) (as `Entry.chunks_for`, clipped to
    the file); looks only at the chunks of the windows the range touches."""
    chunks = entry.chunks_for(offset, size)
    if unit_bytes <= 0 or len(entry.chunks) < 2 or not chunks:
        return chunks
    lo = chunks[0].file_offset // unit_bytes * unit_bytes
    hi = (chunks[-1].file_offset // unit_bytes + 1) * unit_bytes
    window = [c for c in entry.chunks_for(lo, hi - lo) if c.file_offset >= lo]
    end = chunks[-1].end
    begin = chunks[0].file_offset
    return [u for u in group_chunks(window, unit_bytes) if u.end > begin and u.file_offset < end]


class UnitDecoder:
    """`ChunkDecoder` for any unit: a group's compressed bytes are split at its parts' ranges,
    each part decoded and checked against its digest (DigestMismatch, naming `what` and the
    part, as soon as a part's bytes are in); a plain chunk is decoded as by ChunkDecoder (its
    own digest is the caller's to check). `emit` receives the unit's `size` file bytes."""

    def __init__(self, chunk: Chunk, emit: Callable[[bytes], None], *, what: str = "",
                 max_piece: int = DEFAULT_PIECE) -> None:
        self._emit = emit
        self._max_piece = max_piece
        self._what = what or f"chunk at blob offset {chunk.blob_offset}"
        self._parts = chunk.parts if isinstance(chunk, ChunkGroup) else ()
        self._single = None if self._parts else ChunkDecoder(chunk, emit, max_piece=max_piece)
        self._next = 0  # index of the part being decoded
        self._left = 0  # its compressed bytes not yet fed
        self._part: ChunkDecoder | None = None
        self._check: DigestCheck | None = None
        if self._parts:
            self._start_part()

    def _start_part(self) -> None:
        part = self._parts[self._next]
        check = self._check = DigestCheck(part.digest or "", self._part_name(part))

        def take(piece: bytes) -> None:
            check.update(piece)
            self._emit(piece)

        self._part = ChunkDecoder(part, take, max_piece=self._max_piece)
        self._left = part.blob_size

    def _part_name(self, part: Chunk) -> str:
        return f"{self._what}, part at blob offset {part.blob_offset}"

    @contextmanager
    def _part_errors(self) -> Iterator[None]:
        """Bytes of the current part that do not decode are a digest mismatch naming the part
        (every part has a digest)."""
        try:
            yield
        except DigestMismatch:
            raise
        except FormatError as exc:
            raise DigestMismatch(f"{self._part_name(self._parts[self._next])}: compressed bytes do not "
                                 f"decode: {exc}") from exc

    def _end_part(self) -> None:
        assert self._part is not None and self._check is not None
        with self._part_errors():
            self._part.finish()
        self._check.verify()
        self._next += 1
        self._part = self._check = None
        if self._next < len(self._parts):
            self._start_part()

    def feed(self, data: Buffer) -> None:
        if self._single is not None:
            self._single.feed(data)
            return
        view = memoryview(data)
        while len(view) and self._part is not None:
            n = min(self._left, len(view))
            with self._part_errors():
                self._part.feed(view[:n])
            self._left -= n
            view = view[n:]
            if self._left == 0:
                self._end_part()

    def finish(self) -> None:
        """The unit's bytes ended: FormatError if they were short (a group: DigestMismatch)."""
        if self._single is not None:
            self._single.finish()
            return
        if self._part is not None:
            raise DigestMismatch(f"{self._what}: the bytes ended in the part at blob offset "
                                 f"{self._parts[self._next].blob_offset}")


def decode_unit(chunk: Chunk, data: Buffer, *, what: str = "") -> bytes:
    """A unit's `size` file bytes from its compressed blob range `data` (see UnitDecoder)."""
    pieces: list[bytes] = []
    decoder = UnitDecoder(chunk, pieces.append, what=what, max_piece=max(1, chunk.inner_offset + chunk.size))
    decoder.feed(data)
    decoder.finish()
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
