"""The format-neutral layer index: what every lazy format reader produces.

A `LayerIndex` describes one layer (or, for Nydus, one bootstrap over one or more blobs): its
file tree, exactly as the layer tar would create it, and for every regular file the ordered
chunks that hold its bytes in the compressed blob(s).

Contracts:
- Entry names are normalized relative paths without a leading "./" or "/" and without a
  trailing "/"; the root directory is "". `normalize_name` rejects "..", NUL and absolute
  names that would escape the root.
- Whiteouts (`.wh.NAME`) and opaque markers (`.wh..wh..opq`) are kept as ordinary entries with
  their tar names; `Entry.is_whiteout` / `Entry.is_opaque_marker` tell them apart. Applying them
  is the job of whoever merges layers.
- A regular file's chunks are sorted by `file_offset`, are contiguous, and cover [0, size).
  `Entry.chunks_for(offset, size)` finds the covering chunks in O(log n).
- Pure data: no IO, no clocks. Everything is frozen.
"""

from __future__ import annotations

import bisect
import enum
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from snapshotter.errors import FormatError

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
PREFETCH_LANDMARK = ".prefetch.landmark"
NO_PREFETCH_LANDMARK = ".no.prefetch.landmark"
LANDMARK_CONTENTS = b"\x0f"
NO_XATTRS: Mapping[str, bytes] = MappingProxyType({})  # one shared empty mapping for entries without xattrs
# One int object per permission-bit value, for parsers to share (`SHARED_MODES.setdefault(m, m)`):
# a decoded 0o644 is a new 28-byte object per entry otherwise (CPython caches only -5..256), and
# the mount keeps one per entry and per node. At most 4096 keys, as modes are masked to 0o7777.
SHARED_MODES: dict[int, int] = {}


class EntryType(enum.Enum):
    DIR = "dir"
    REG = "reg"
    SYMLINK = "symlink"
    HARDLINK = "hardlink"
    CHAR = "char"
    BLOCK = "block"
    FIFO = "fifo"


# The types as module names, for hot loops: `EntryType.REG` is a class attribute lookup (60 ns
# against 9 ns for a module name), and parses and tree builds test a few per file.
TYPE_DIR, TYPE_REG, TYPE_SYMLINK, TYPE_HARDLINK, TYPE_CHAR, TYPE_BLOCK = (
    EntryType.DIR, EntryType.REG, EntryType.SYMLINK, EntryType.HARDLINK, EntryType.CHAR, EntryType.BLOCK)


class Compression(enum.Enum):
    NONE = "none"
    GZIP = "gzip"
    ZSTD = "zstd"
    LZ4_BLOCK = "lz4_block"


class Landmark(enum.Enum):
    """Which prefetch landmark a layer carries."""

    NONE = "none"
    PREFETCH = "prefetch"
    NO_PREFETCH = "no_prefetch"


# Chunk and Entry are values: nothing changes one after it is made (use dataclasses.replace).
# They are not declared frozen only for speed: a frozen dataclass's __init__ sets each field
# through object.__setattr__, which made parsing an 11k-entry TOC 12 ms slower and loading its
# index in a mount process 16 ms slower, both on a container's start path. Equality and hashing
# are by value, as before (unsafe_hash).
@dataclass(slots=True, unsafe_hash=True)
class Chunk:
    """One piece of a regular file, as stored in a blob.

    file_offset/size: the uncompressed byte range of the file this chunk holds.
    blob_offset/blob_size: the compressed byte range of the blob to fetch; decompressing it
      (with `compression`) yields at least inner_offset + size bytes.
    inner_offset: uncompressed bytes to skip after decompressing from blob_offset (eStargz
      innerOffset; Nydus and most others: 0).
    digest: "ALGO:hex" of the chunk's uncompressed bytes (sha256 or blake3), or None if the
      format records none (then the file digest is the only check).
    blob_index: which blob of the index's `blobs` holds it (0 for single-blob layers).
    zeros: the chunk's bytes are all zeros (zstd:chunked chunkType "zeros"); a reader may
      produce them without fetching the blob range (which still decompresses to zeros).
    """

    file_offset: int
    size: int
    blob_offset: int
    blob_size: int
    compression: Compression
    digest: str | None
    inner_offset: int = 0
    blob_index: int = 0
    zeros: bool = False

    @property
    def end(self) -> int:
        return self.file_offset + self.size


@dataclass(slots=True, unsafe_hash=True)
class Entry:
    """One tar entry of a layer (a value: see Chunk).

    mode holds permission bits only (0o7777); the type is `type`.
    link_target: symlink target, or for HARDLINK the normalized name of the entry linked to.
    mtime_ns: modification time in nanoseconds since the epoch.
    nlink: link count as the layer would produce it (hard links counted).
    digest: "ALGO:hex" of the whole file's content, when the format records one.
    """

    name: str
    type: EntryType
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    link_target: str = ""
    dev_major: int = 0
    dev_minor: int = 0
    xattrs: Mapping[str, bytes] = field(default_factory=lambda: NO_XATTRS)
    nlink: int = 1
    digest: str | None = None
    chunks: tuple[Chunk, ...] = ()

    @property
    def basename(self) -> str:
        return posixpath.basename(self.name)

    @property
    def parent(self) -> str:
        return posixpath.dirname(self.name)

    @property
    def is_whiteout(self) -> bool:
        """A `.wh.NAME` entry that deletes NAME from lower layers (not the opaque marker)."""
        base = self.basename
        return base.startswith(WHITEOUT_PREFIX) and base != OPAQUE_MARKER

    @property
    def is_opaque_marker(self) -> bool:
        return self.basename == OPAQUE_MARKER

    @property
    def whiteout_target(self) -> str:
        """The name a whiteout deletes. Only meaningful when `is_whiteout`."""
        return posixpath.join(self.parent, self.basename[len(WHITEOUT_PREFIX):])

    def chunks_for(self, offset: int, size: int) -> Sequence[Chunk]:
        """The chunks covering file bytes [offset, offset+size), clipped to the file's size.

        O(log n) in the number of chunks.
        """
        if offset < 0 or size < 0:
            raise ValueError(f"negative range {offset}+{size} for {self.name!r}")
        end = min(offset + size, self.size)
        if offset >= end or not self.chunks:
            return ()
        first = bisect.bisect_right(self.chunks, offset, key=lambda c: c.file_offset) - 1
        last = bisect.bisect_left(self.chunks, end, key=lambda c: c.file_offset)
        return self.chunks[max(first, 0):last]


@dataclass(frozen=True)
class LayerIndex:
    """A layer's tree and chunk map.

    entries: in the order the layer holds them (tar order / bootstrap walk order).
    blobs: identifiers of the blobs chunks refer to by `blob_index` (layer digest for eStargz
      and zstd:chunked; blob ids for Nydus).
    prefetch: names of regular files that precede the prefetch landmark, in layer order.
    toc_digest: "sha256:hex" of the TOC as the format defines it, when there is one.
    """

    format: str
    entries: tuple[Entry, ...]
    blobs: tuple[str, ...] = ()
    landmark: Landmark = Landmark.NONE
    prefetch: tuple[str, ...] = ()
    toc_digest: str | None = None
    _by_name: Mapping[str, Entry] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def by_name(self) -> Mapping[str, Entry]:
        """name -> Entry, built on first use (a mount process of a big layer may never need it)."""
        if self._by_name is None:
            object.__setattr__(self, "_by_name", MappingProxyType({e.name: e for e in self.entries}))
        assert self._by_name is not None
        return self._by_name

    def get(self, name: str) -> Entry | None:
        return self.by_name.get(name)

    def __getitem__(self, name: str) -> Entry:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"no entry {name!r} in {self.format} layer index") from None

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.entries)

    def regular_files(self) -> Iterable[Entry]:
        return (e for e in self.entries if e.type is EntryType.REG)


def normalize_name(raw: str, *, allow_root: bool = True) -> str:
    """Normalize a tar/TOC entry name; reject names that could escape the layer root.

    "./a/b/" -> "a/b"; "." or "./" -> "" (root). Raises FormatError naming the entry for
    NUL bytes, absolute paths, and any ".." component.
    """
    if "\x00" in raw:
        raise FormatError(f"entry name {raw!r} contains a NUL byte")
    if raw.startswith("/"):
        raise FormatError(f"entry name {raw!r} is absolute; layer entries must be relative")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise FormatError(f"entry name {raw!r} contains '..'")
    name = "/".join(parts)
    if not name and not allow_root:
        raise FormatError(f"entry name {raw!r} names the root directory")
    return name


def check_chunks(entry: Entry) -> None:
    """Raise FormatError unless entry's chunks are sorted, contiguous and cover [0, size)."""
    if entry.type is not TYPE_REG:
        if entry.chunks:
            raise FormatError(f"{entry.type.value} entry {entry.name!r} has chunks")
        return
    expected = 0
    for chunk in entry.chunks:
        if chunk.file_offset != expected:
            raise FormatError(
                f"file {entry.name!r}: chunk at offset {chunk.file_offset}, expected {expected}"
            )
        if chunk.size <= 0 or chunk.blob_offset < 0 or chunk.blob_size < 0 or chunk.inner_offset < 0:
            raise FormatError(f"file {entry.name!r}: bad chunk {chunk}")
        expected = chunk.end
    if expected != entry.size:
        raise FormatError(f"file {entry.name!r}: chunks cover {expected} bytes of {entry.size}")
