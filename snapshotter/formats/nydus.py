"""Nydus RAFS v6 bootstraps: read one into a LayerIndex (`parse_bootstrap`), write one (`write_nydus`).

Reader contract (`parse_bootstrap(data, max_bootstrap_bytes=N)`):
- format "nydus"; `blobs` = blob ids of the blob table in table order; chunks refer to them by
  `blob_index`. Each regular file's chunks come from its chunk-index array -> blob table ->
  chunk info, taken from the bootstrap chunk table or, when given, the blob's CI array
  (`ci_arrays={blob_index: uncompressed CI bytes}`, see `blob_ci_range`; digests then from
  `blob_digests` or the chunk table). Chunk digests are
  "blake3:hex" or "sha256:hex" per the bootstrap's hash flag.
- the tree is walked from the root nid in dirent order (bytewise sorted): parents before
  children. A second dirent naming an already seen non-directory nid becomes a HARDLINK entry
  to the first name. Prefetch nids become names (a directory expands to the regular files
  under it).
- hostile input: size capped by max_bootstrap_bytes (LimitExceeded); every offset bounds
  checked; directory cycles, out-of-range nids, bad names ('', '.', '..', '/' or NUL inside),
  unknown layouts and inconsistent chunk info raise FormatError. Work is linear in the size
  of the bootstrap: the total number of dirents and of chunk indexes is capped by what the
  bootstrap's bytes could honestly hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, overload

from snapshotter.errors import FormatError, LimitExceeded
from snapshotter.formats import rafs_layout as L
from snapshotter.formats.index import NO_XATTRS, SHARED_MODES, Chunk, Compression, Entry, EntryType, LayerIndex
from snapshotter.formats.index import TYPE_BLOCK as _BLOCK
from snapshotter.formats.index import TYPE_CHAR as _CHAR
from snapshotter.formats.index import TYPE_DIR as _DIR
from snapshotter.formats.index import TYPE_HARDLINK as _HARDLINK
from snapshotter.formats.index import TYPE_REG as _REG
from snapshotter.formats.index import TYPE_SYMLINK as _SYMLINK
from snapshotter.gcpause import gc_paused

if TYPE_CHECKING:
    from snapshotter.formats.rafs_writer import NydusResult, write_nydus

__all__ = [
    "RAFS_MAX_CHUNK_SIZE",
    "BootstrapInfo",
    "blob_ci_range",
    "parse_blob_toc",
    "TocEntry",
    "parse_bootstrap",
    "read_bootstrap_info",
    "write_nydus",
    "NydusResult",
]

RAFS_MAX_CHUNK_SIZE = 16 << 20
_MAX_BLOBS = 255  # blob_index + 1 must fit the 8-bit device id of a chunk index
_MAX_SYMLINK = 4096
_MAX_NAME = 16384  # bytes of a full path; bounds memory on hostile deep trees


# The two fields of a chunk table record that identify it: blob_index and index.
_CHUNK_KEY = struct.Struct("<32xI36xI4x")


class ChunkTable(Sequence[L.ChunkInfo]):
    """The bootstrap's chunk table, each record decoded when it is asked for: a table of a
    million chunks would otherwise be a million objects (three times its bytes) for as long as
    the parse runs."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) % L.CHUNK_INFO_SIZE:
            raise ValueError(f"chunk table of {len(raw)} bytes is not a whole number of records")
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw) // L.CHUNK_INFO_SIZE

    @overload
    def __getitem__(self, i: int) -> L.ChunkInfo: ...

    @overload
    def __getitem__(self, i: slice) -> list[L.ChunkInfo]: ...

    def __getitem__(self, i: int | slice) -> L.ChunkInfo | list[L.ChunkInfo]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"chunk table record {i} of {n}")
        return L.unpack_chunk_info(self._raw, (i % n) * L.CHUNK_INFO_SIZE)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkTable) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    def fields(self, i: int) -> tuple[Any, ...]:
        """Record `i` (0 <= i < len) as a plain tuple in ChunkInfo field order."""
        return L.chunk_info_fields(self._raw, i * L.CHUNK_INFO_SIZE)

    def keys(self) -> Iterator[tuple[int, int]]:
        """(blob_index, index) of each record, in table order, without decoding the rest."""
        return _CHUNK_KEY.iter_unpack(self._raw)


@dataclass(frozen=True)
class BootstrapInfo:
    """The bootstrap's fixed tables, validated: superblocks, blob table, chunk table."""

    sb: L.SuperBlock
    ext: L.ExtSuperBlock
    blobs: tuple[L.BlobEntry, ...]
    chunk_table: ChunkTable
    prefetch_nids: tuple[int, ...]

    @property
    def block_size(self) -> int:
        return 1 << self.sb.blkszbits

    @property
    def digest_algo(self) -> str:
        return "blake3" if self.ext.flags & L.FLAG_HASH_BLAKE3 else "sha256"


def _slice(data: bytes, off: int, size: int, what: str) -> bytes:
    if off < 0 or size < 0 or off + size > len(data):
        raise _outside(data, off, size, what)
    return data[off:off + size]


def _outside(data: bytes, off: int, size: int, what: str) -> FormatError:
    return FormatError(f"nydus bootstrap: {what} [{off}, {off + size}) is outside the {len(data)}-byte bootstrap")


def _one_flag(flags: int, choices: Mapping[Any, int], what: str) -> None:
    found = [k for k, bit in choices.items() if flags & bit]
    if len(found) != 1:
        raise FormatError(f"nydus bootstrap: flags {flags:#x} must set exactly one {what} bit")


def read_bootstrap_info(data: bytes, *, max_bootstrap_bytes: int) -> BootstrapInfo:
    """Validate the superblocks and read the blob, chunk and prefetch tables."""
    if len(data) > max_bootstrap_bytes:
        raise LimitExceeded(f"nydus bootstrap is {len(data)} bytes, more than the {max_bootstrap_bytes}-byte cap")
    magic, sb = L.unpack_sb(_slice(data, L.SB_OFFSET, 128, "EROFS superblock"))
    if magic != L.EROFS_MAGIC:
        raise FormatError(f"nydus bootstrap: bad EROFS magic {magic:#x}")
    if not sb.feature_compat & L.FEATURE_COMPAT_RAFS_V6:
        raise FormatError("nydus bootstrap: superblock lacks the RAFS_V6 compat feature")
    if sb.blkszbits not in (9, 12):
        raise FormatError(f"nydus bootstrap: unsupported block size bits {sb.blkszbits}")
    if sb.feature_incompat & ~L.RAFS_V6_INCOMPAT:
        raise FormatError(f"nydus bootstrap: unsupported incompat features {sb.feature_incompat:#x}")
    if sb.xattr_blkaddr != 0:
        raise FormatError("nydus bootstrap: shared xattrs are not supported")
    if sb.extra_devices > _MAX_BLOBS:
        raise FormatError(f"nydus bootstrap: {sb.extra_devices} devices, at most {_MAX_BLOBS} supported")
    ext = L.unpack_ext_sb(_slice(data, L.EXT_SB_OFFSET, 256, "RAFS extended superblock"))
    _one_flag(ext.flags, L.COMP_FLAGS, "compression")
    _one_flag(ext.flags, L.HASH_FLAGS, "digest")
    cs = ext.chunk_size
    if cs < 4096 or cs > RAFS_MAX_CHUNK_SIZE or cs & (cs - 1):
        raise FormatError(f"nydus bootstrap: bad chunk size {cs}")
    if ext.flags & (L.FLAG_TARFS_MODE | 0x0200_0000):
        raise FormatError("nydus bootstrap: tarfs mode and encrypted images are not supported")

    if ext.blob_table_size % L.BLOB_ENTRY_SIZE:
        raise FormatError(f"nydus bootstrap: blob table size {ext.blob_table_size} is not a multiple of 256")
    table = _slice(data, ext.blob_table_offset, ext.blob_table_size, "blob table")
    n_blobs = len(table) // L.BLOB_ENTRY_SIZE
    if n_blobs > _MAX_BLOBS:
        raise FormatError(f"nydus bootstrap: {n_blobs} blobs, at most {_MAX_BLOBS} supported")
    blobs: list[L.BlobEntry] = []
    for i in range(n_blobs):
        raw_id, entry = L.unpack_blob(table[i * 256:(i + 1) * 256])
        raw_id = raw_id.rstrip(b"\x00")
        if not raw_id or b"\x00" in raw_id or b"/" in raw_id or not raw_id.isascii() or raw_id in (b".", b".."):
            raise FormatError(f"nydus bootstrap: blob {i} has an invalid id {raw_id!r}")
        if entry.blob_index != i:
            raise FormatError(f"nydus bootstrap: blob table entry {i} claims index {entry.blob_index}")
        if entry.compression_algo not in L.BLOB_COMPRESSION:
            raise FormatError(f"nydus bootstrap: blob {i} has unknown compression {entry.compression_algo}")
        if entry.digest_algo not in L.BLOB_DIGEST:
            raise FormatError(f"nydus bootstrap: blob {i} has unknown digest algorithm {entry.digest_algo}")
        if entry.features & (L.BLOB_ZRAN | L.BLOB_BATCH | L.BLOB_ENCRYPTED | L.BLOB_TARFS) or entry.cipher_algo:
            raise FormatError(f"nydus bootstrap: blob {i} uses unsupported features {entry.features:#x}")
        blobs.append(_replace_id(entry, raw_id.decode("ascii")))

    if ext.chunk_table_size % L.CHUNK_INFO_SIZE:
        raise FormatError(f"nydus bootstrap: chunk table size {ext.chunk_table_size} is not a multiple of 80")
    ct = _slice(data, ext.chunk_table_offset, ext.chunk_table_size, "chunk table")
    chunk_table = ChunkTable(ct)

    if ext.prefetch_table_size % 4:
        raise FormatError(f"nydus bootstrap: prefetch table size {ext.prefetch_table_size} is not a multiple of 4")
    pt = _slice(data, ext.prefetch_table_offset, ext.prefetch_table_size, "prefetch table")
    prefetch = tuple(int.from_bytes(pt[i:i + 4], "little") for i in range(0, len(pt), 4))
    return BootstrapInfo(sb, ext, tuple(blobs), chunk_table, prefetch)


def _replace_id(entry: L.BlobEntry, blob_id: str) -> L.BlobEntry:
    return dataclasses.replace(entry, blob_id=blob_id)


def blob_ci_range(entry: L.BlobEntry) -> tuple[int, int]:
    """(offset, size) in the blob of its compressed CI array; decompress it with `ci_compressor`
    to `ci_uncompressed_size` bytes and pass it to parse_bootstrap's `ci_arrays`."""
    return entry.ci_offset, entry.ci_compressed_size


@dataclass(frozen=True)
class TocEntry:
    """One entry of a blob's "rafs.blob.toc": a named section of the blob."""

    name: str
    flags: int
    sha256: bytes
    compressed_offset: int
    compressed_size: int
    uncompressed_size: int


def parse_blob_toc(entry: L.BlobEntry, tail: bytes) -> dict[str, TocEntry]:
    """The ToC of a blob from its last `entry.toc_size` bytes (checked against the blob table's
    toc digest). Sections: "blob.meta" (CI array), "blob.meta.header", "blob.digest", ..."""
    if entry.toc_size < 512 or (entry.toc_size - 512) % 128 or len(tail) != entry.toc_size:
        raise FormatError(f"nydus blob {entry.blob_id}: bad ToC size {entry.toc_size}")
    if hashlib.sha256(tail).digest() != entry.toc_digest:
        raise FormatError(f"nydus blob {entry.blob_id}: ToC does not match the bootstrap's ToC digest")
    out: dict[str, TocEntry] = {}
    for off in range(0, entry.toc_size - 512, 128):
        rec = tail[off:off + 128]
        name = rec[8:24].split(b"\x00", 1)[0].decode("ascii", "replace")
        out[name] = TocEntry(name, int.from_bytes(rec[0:4], "little"), rec[24:56],
                             int.from_bytes(rec[56:64], "little"), int.from_bytes(rec[64:72], "little"),
                             int.from_bytes(rec[72:80], "little"))
    return out


_LAYOUTS = frozenset((L.LAYOUT_FLAT_PLAIN, L.LAYOUT_FLAT_INLINE, L.LAYOUT_CHUNK_BASED))
_UNSUPPORTED_CHUNK_FLAGS = L.CHUNK_ENCRYPTED | L.CHUNK_BATCH | L.CHUNK_HOLE
_TYPES = {
    L.S_IFDIR: EntryType.DIR, L.S_IFREG: EntryType.REG, L.S_IFLNK: EntryType.SYMLINK,
    L.S_IFCHR: EntryType.CHAR, L.S_IFBLK: EntryType.BLOCK, L.S_IFIFO: EntryType.FIFO,
}


class _Reader:
    def __init__(self, data: bytes, info: BootstrapInfo, ci_arrays: Mapping[int, bytes] | None,
                 blob_digests: Mapping[int, bytes] | None) -> None:
        self.data = data
        self.info = info
        self.bs = info.block_size
        self.meta_base = info.sb.meta_blkaddr * self.bs
        if self.meta_base >= len(data):
            raise FormatError(f"nydus bootstrap: metadata block {info.sb.meta_blkaddr} is past the end")
        # Honest bootstraps spend >= 12 bytes per dirent and 8 per chunk index: cap work by that.
        self.dirent_budget = len(data) // L.DIRENT_SIZE + 2
        self.chunk_budget = len(data) // L.CHUNK_INDEX_SIZE + 1
        self._mtimes: dict[int, int] = {}  # one int per distinct mtime (compact inodes share a few)
        # Xattr areas and directory/symlink bytes are unique in an honest bootstrap; overlapping
        # nids or shared blocks in a hostile one could make us re-read them without end.
        self.byte_budget = len(data) + 8192
        self.name_budget = (64 << 20) + 16 * len(data)
        self.xattr_cache: dict[int, Mapping[str, bytes]] = {}
        # (blob_index << 32 | index) -> position in the chunk table; the first record of a key wins
        self.chunk_positions: dict[int, int] = {}
        for pos, (blob_index, index) in enumerate(info.chunk_table.keys()):
            self.chunk_positions.setdefault(blob_index << 32 | index, pos)
        self.ci_arrays = dict(ci_arrays or {})
        self.chunk_size = info.ext.chunk_size
        self.digest_prefix = info.digest_algo + ":"
        self.blob_digests = dict(blob_digests or {})

    # -- inodes ---------------------------------------------------------------------------------
    def inode_offset(self, nid: int) -> int:
        return self.meta_base + nid * L.INODE_SLOT

    def inode(self, nid: int) -> L.Inode:
        """Inode `nid`, parsed each time it is asked for (only a hard link's is asked twice:
        keeping every parsed inode made them the bulk of a parse's peak memory)."""
        data = self.data
        off = self.meta_base + nid * L.INODE_SLOT
        if nid < 0 or off + L.COMPACT_INODE_SIZE > len(data):
            raise FormatError(f"nydus bootstrap: nid {nid} is outside the bootstrap")
        fmt = data[off] | data[off + 1] << 8
        if fmt & ~0xF:
            raise FormatError(f"nydus bootstrap: nid {nid} has unknown inode format bits {fmt:#x}")
        if fmt & 1 and off + L.EXTENDED_INODE_SIZE > len(data):
            raise _outside(data, off, L.EXTENDED_INODE_SIZE, f"inode {nid}")
        ino = L.unpack_inode_at(data, off)
        if ino.layout not in _LAYOUTS:
            raise FormatError(f"nydus bootstrap: nid {nid} has unsupported data layout {ino.layout}")
        if ino.xattr_icount and off + ino.inode_size + ino.xattr_size > len(data):
            raise _outside(data, off, ino.inode_size + ino.xattr_size, f"xattrs of inode {nid}")
        return ino

    def _spend(self, n: int, what: str) -> None:
        self.byte_budget -= n
        if self.byte_budget < 0:
            raise FormatError(f"nydus bootstrap: {what} re-reads more bytes than the bootstrap holds")

    def xattrs(self, nid: int, ino: L.Inode) -> Mapping[str, bytes]:
        if ino.xattr_icount == 0:
            return MappingProxyType({})
        cached = self.xattr_cache.get(nid)
        if cached is not None:
            return cached
        self._spend(ino.xattr_size, f"xattrs of inode {nid}")
        start = self.inode_offset(nid) + ino.inode_size
        area = _slice(self.data, start, ino.xattr_size, f"xattrs of inode {nid}")
        if area[4] != 0:
            raise FormatError(f"nydus bootstrap: inode {nid} uses shared xattrs (unsupported)")
        out: dict[str, bytes] = {}
        pos = L.XATTR_IBODY_HEADER
        while pos + L.XATTR_ENTRY_HEADER <= len(area):
            name_len, index, value_size = area[pos], area[pos + 1], int.from_bytes(area[pos + 2:pos + 4], "little")
            if name_len == 0 and index == 0 and value_size == 0:
                break  # zero padding after the last entry
            end = pos + L.XATTR_ENTRY_HEADER + name_len + value_size
            if end > len(area):
                raise FormatError(f"nydus bootstrap: xattr entry of inode {nid} runs past its area")
            prefix = L.XATTR_PREFIXES.get(index)
            if prefix is None:
                raise FormatError(f"nydus bootstrap: inode {nid} has xattr with unknown name index {index}")
            suffix = area[pos + 4:pos + 4 + name_len]
            if b"\x00" in suffix:
                raise FormatError(f"nydus bootstrap: inode {nid} has an xattr name with a NUL byte")
            name = prefix + suffix.decode("utf-8", "surrogateescape")
            out[name] = bytes(area[pos + 4 + name_len:end])
            pos = (end + 3) & ~3
        result = MappingProxyType(out)
        self.xattr_cache[nid] = result
        return result

    def flat_data(self, nid: int, ino: L.Inode, limit: int) -> bytes:
        """The bytes of a directory or symlink (FLAT_PLAIN / FLAT_INLINE)."""
        size = ino.size
        if size > limit:
            raise FormatError(f"nydus bootstrap: inode {nid} claims {size} bytes of data, more than {limit}")
        self._spend(size, f"data of inode {nid}")
        if ino.layout == L.LAYOUT_FLAT_PLAIN:
            return _slice(self.data, ino.i_u * self.bs, size, f"data of inode {nid}")
        if ino.layout == L.LAYOUT_FLAT_INLINE:
            tail = size % self.bs
            head = size - tail
            if tail == 0 and size:
                # Inline layout with a zero-length tail: every byte lives in full blocks.
                return _slice(self.data, ino.i_u * self.bs, size, f"data of inode {nid}")
            body = _slice(self.data, ino.i_u * self.bs, head, f"data of inode {nid}") if head else b""
            inline_off = self.inode_offset(nid) + ino.inode_size + ino.xattr_size
            if inline_off % self.bs + tail > self.bs:
                raise FormatError(f"nydus bootstrap: inline data of inode {nid} crosses a block boundary")
            return body + _slice(self.data, inline_off, tail, f"inline data of inode {nid}")
        raise FormatError(f"nydus bootstrap: inode {nid} (mode {ino.mode:o}) has chunk-based layout")

    # -- directories ----------------------------------------------------------------------------
    def dirents(self, nid: int, ino: L.Inode) -> list[tuple[bytes, int]]:
        body = self.flat_data(nid, ino, len(self.data))
        out: list[tuple[bytes, int]] = []
        for bstart in range(0, len(body), self.bs):
            block = body[bstart:bstart + self.bs]
            if len(block) < L.DIRENT_SIZE:
                raise FormatError(f"nydus bootstrap: directory {nid} has a truncated dirent block")
            first_nameoff = L.unpack_dirent(block, 0)[1]
            if first_nameoff % L.DIRENT_SIZE or not L.DIRENT_SIZE <= first_nameoff <= len(block):
                raise FormatError(f"nydus bootstrap: directory {nid} has bad first name offset {first_nameoff}")
            n = first_nameoff // L.DIRENT_SIZE
            self.dirent_budget -= n
            if self.dirent_budget < 0:
                raise FormatError("nydus bootstrap: more dirents than the bootstrap can hold (shared dir blocks?)")
            ents = [L.unpack_dirent(block, i * L.DIRENT_SIZE) for i in range(n)]
            for i, (child, nameoff, _ft) in enumerate(ents):
                end = ents[i + 1][1] if i + 1 < n else len(block)
                if not first_nameoff <= nameoff < end <= len(block):
                    raise FormatError(f"nydus bootstrap: directory {nid} has bad name offsets")
                name = block[nameoff:end]
                if i + 1 == n:
                    name = name.split(b"\x00", 1)[0]
                out.append((name, child))
        return out

    # -- regular files --------------------------------------------------------------------------
    def chunk_info(self, blob_index: int, ci_index: int) -> L.ChunkInfo:
        arr = self.ci_arrays.get(blob_index)
        if arr is not None:
            blob = self.info.blobs[blob_index]
            v2 = bool(blob.features & L.BLOB_CHUNK_INFO_V2)
            width = 24 if v2 else 16
            if ci_index >= blob.chunk_count or (ci_index + 1) * width > len(arr):
                raise FormatError(f"nydus bootstrap: chunk {ci_index} is outside blob {blob_index}'s CI array")
            if v2:
                uoff, usize, coff, csize, flags = L.decode_ci_v2(arr, ci_index * width)
                compressed = bool(flags & 1)
                if flags & ~0x11:
                    raise FormatError(f"nydus blob {blob_index}: chunk {ci_index} has unsupported flags {flags:#x}")
            else:
                uoff, usize, coff, csize = L.decode_ci_v1(arr, ci_index * width)
                compressed = csize != usize
            digest = self._ci_digest(blob_index, ci_index)
            return L.ChunkInfo(digest, blob_index, L.CHUNK_COMPRESSED if compressed else 0, csize, usize,
                               coff, uoff, 0, ci_index)
        found = self._table_record(blob_index, ci_index)
        if found is None:
            raise FormatError(
                f"nydus bootstrap: no chunk info for blob {blob_index} chunk {ci_index} in the chunk table "
                "(pass the blob's CI array)"
            )
        return found

    def _table_record(self, blob_index: int, ci_index: int) -> L.ChunkInfo | None:
        in_range = 0 <= blob_index < 1 << 32 and 0 <= ci_index < 1 << 32  # else the two halves would mix
        pos = self.chunk_positions.get(blob_index << 32 | ci_index) if in_range else None
        return None if pos is None else self.info.chunk_table[pos]

    def _ci_digest(self, blob_index: int, ci_index: int) -> bytes:
        arr = self.blob_digests.get(blob_index)
        if arr is not None and len(arr) >= (ci_index + 1) * 32:
            return arr[ci_index * 32:(ci_index + 1) * 32]
        found = self._table_record(blob_index, ci_index)
        if found is None:
            raise FormatError(f"nydus bootstrap: no digest for blob {blob_index} chunk {ci_index}")
        return found.digest

    def chunks(self, nid: int, ino: L.Inode, name: str) -> tuple[Chunk, ...]:
        """A regular file's chunks, contiguous from offset 0 to its size (so by construction what
        `check_chunks` asks of them), each checked against its chunk info."""
        if ino.size == 0:
            return ()
        if ino.layout != L.LAYOUT_CHUNK_BASED:
            raise FormatError(f"nydus bootstrap: file {name!r} has non-chunk layout {ino.layout}")
        cs = self.chunk_size
        size = ino.size
        count = -(-size // cs)
        self.chunk_budget -= count
        if self.chunk_budget < 0:
            raise FormatError(f"nydus bootstrap: file {name!r} claims more chunks than the bootstrap can hold")
        start = (self.meta_base + nid * L.INODE_SLOT + ino.inode_size + ino.xattr_size + 7) & ~7
        end = start + count * L.CHUNK_INDEX_SIZE
        if end > len(self.data):
            raise _outside(self.data, start, end - start, f"chunk indexes of {name!r}")
        arr = self.data[start:end]
        blobs = self.info.blobs
        n_blobs = len(blobs)
        prefix = self.digest_prefix
        positions = self.chunk_positions
        table = self.info.chunk_table
        ci_arrays = self.ci_arrays
        bs = self.bs
        out: list[Chunk] = []
        for i, (lo, hi, blkaddr) in enumerate(L.iter_chunk_indexes(arr)):
            dev = hi & 0xFF
            if dev == 0 or dev > n_blobs:
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i} names device {dev}")
            blob_index = dev - 1
            ci_index = ((hi >> 8) << 16) | lo
            pos = None if blob_index in ci_arrays else positions.get(blob_index << 32 | ci_index)
            if pos is not None:  # the usual case: the record, as a tuple, from the bootstrap's chunk table
                digest, info_blob, flags, csize, usize, coff, uoff, _foff, info_index, _crc = table.fields(pos)
            else:
                info = self.chunk_info(blob_index, ci_index)
                digest, info_blob, flags, csize = info.digest, info.blob_index, info.flags, info.compressed_size
                usize, coff, uoff, info_index = (info.uncompressed_size, info.compressed_offset,
                                                 info.uncompressed_offset, info.index)
            offset = i * cs
            # (A one-chunk file's chunk gets the file's own size int.)
            want = cs if size - offset > cs else (size - offset if offset else size)
            if info_blob != blob_index or info_index != ci_index:
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i}: chunk info does not match its index")
            if usize != want:
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i} holds {usize} bytes, expected {want}")
            if blkaddr * bs != uoff:
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i}: block address disagrees with chunk info")
            if flags & _UNSUPPORTED_CHUNK_FLAGS:
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i} has unsupported flags {flags:#x}")
            blob = blobs[blob_index]
            compressed = flags & L.CHUNK_COMPRESSED
            # A compressed chunk never exceeds its plain size much; a raw one is exactly it. This
            # keeps a hostile chunk table from making a fetcher pull gigabytes for one chunk.
            if csize <= 0 or csize > want + 4096 or (not compressed and csize != want):
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i} has bad compressed size {csize}")
            if blob.compressed_size and coff + csize > blob.compressed_size:
                raise FormatError(f"nydus bootstrap: file {name!r} chunk {i} lies past the end of blob {blob_index}")
            comp = L.BLOB_COMPRESSION[blob.compression_algo] if compressed else Compression.NONE
            out.append(Chunk(offset, want, coff, csize, comp, prefix + digest.hex(), 0, blob_index))
        return tuple(out)

    # -- tree -----------------------------------------------------------------------------------
    def walk(self) -> tuple[list[Entry], dict[int, str], dict[int, tuple[int, int]]]:
        """(entries in DFS preorder, nid -> first name, dir nid -> its subtree's index range)."""
        root = self.info.sb.root_nid
        entries: list[Entry] = []
        first_name: dict[int, str] = {}
        ranges: dict[int, tuple[int, int]] = {}
        stack: list[tuple[str, int, int]] = [("", root, root)]
        while stack:
            name, nid, parent_nid = stack.pop()
            if nid < 0:
                dir_nid = -nid - 1  # end-of-subtree marker pushed below a directory's children
                ranges[dir_nid] = (ranges[dir_nid][0], len(entries))
                continue
            if len(name) > _MAX_NAME:
                raise FormatError(f"nydus bootstrap: path {name[:64]!r}... is longer than {_MAX_NAME} bytes")
            self.name_budget -= len(name)
            if self.name_budget < 0:
                raise FormatError("nydus bootstrap: entry names add up to more than the bootstrap can justify")
            ino = self.inode(nid)
            ftype = _TYPES.get(ino.mode & L.S_IFMT)
            if name == "" and ftype is not _DIR:
                raise FormatError("nydus bootstrap: root inode is not a directory")
            if ftype is None:
                if ino.mode & L.S_IFMT == L.S_IFSOCK:
                    continue  # sockets cannot be expressed in a layer tar
                raise FormatError(f"nydus bootstrap: {name!r} has unknown file type (mode {ino.mode:o})")
            if nid in first_name:
                if ftype is _DIR:
                    raise FormatError(f"nydus bootstrap: directory nid {nid} is reachable twice (cycle?)")
                entries.append(self._entry(name, nid, ino, _HARDLINK, link=first_name[nid]))
                continue
            first_name[nid] = name
            if ftype is _DIR:
                ranges[nid] = (len(entries), len(entries) + 1)
                entries.append(self._entry(name, nid, ino, ftype))
                stack.append(("", -nid - 1, 0))
                children = []
                seen_names: set[bytes] = set()
                for raw, child in self.dirents(nid, ino):
                    if raw in (b".", b".."):
                        # Self and parent links are never entries; they must say what they are.
                        if child != (nid if raw == b"." else parent_nid):
                            raise FormatError(f"nydus bootstrap: directory {name!r} has a bad {raw.decode()!r} entry")
                        continue
                    if not raw or b"/" in raw or b"\x00" in raw:
                        raise FormatError(f"nydus bootstrap: directory {name!r} has invalid entry name {raw!r}")
                    if raw in seen_names:
                        raise FormatError(f"nydus bootstrap: directory {name!r} lists {raw!r} twice")
                    seen_names.add(raw)
                    child_name = raw.decode("utf-8", "surrogateescape")
                    children.append((f"{name}/{child_name}" if name else child_name, child, nid))
                stack.extend(reversed(children))
            else:
                entries.append(self._entry(name, nid, ino, ftype))
        return entries, first_name, ranges

    def _entry(self, name: str, nid: int, ino: L.Inode, ftype: EntryType, *, link: str = "") -> Entry:
        if ino.extended:
            mtime_ns = ino.mtime * 1_000_000_000 + ino.mtime_nsec
        else:  # what the kernel shows: build time + the compact inode's relative seconds
            mtime_ns = (self.info.sb.build_time + ino.mtime) * 1_000_000_000 + self.info.sb.build_time_nsec
        xattrs = self.xattrs(nid, ino) if ino.xattr_icount else NO_XATTRS
        size, major, minor = 0, 0, 0
        chunks: tuple[Chunk, ...] = ()
        if ftype is _REG:
            size, chunks = ino.size, self.chunks(nid, ino, name)
        elif ftype is _SYMLINK:
            target = self.flat_data(nid, ino, _MAX_SYMLINK)
            if not target or b"\x00" in target:
                raise FormatError(f"nydus bootstrap: symlink {name!r} has an empty or NUL-containing target")
            link = target.decode("utf-8", "surrogateescape")
        elif ftype is _CHAR or ftype is _BLOCK:
            major, minor = L.decode_dev(ino.i_u)
        # Positional, in Entry's field order (a keyword call costs twice as much, 11k times).
        mode = ino.mode & 0o7777
        return Entry(name, ftype, SHARED_MODES.setdefault(mode, mode), ino.uid, ino.gid,
                     self._mtimes.setdefault(mtime_ns, mtime_ns), size, link, major, minor,
                     xattrs, ino.nlink, None, chunks)


def parse_bootstrap(data: bytes, *, max_bootstrap_bytes: int, ci_arrays: Mapping[int, bytes] | None = None,
                    blob_digests: Mapping[int, bytes] | None = None) -> LayerIndex:
    """Parse a RAFS v6 bootstrap into a LayerIndex (see the module docstring).

    ci_arrays / blob_digests: optional per-blob uncompressed CI arrays and "blob.digest" arrays
    (32 bytes per chunk, by CI index) read from the blobs; when given they replace the bootstrap
    chunk table as the source of chunk info / digests for that blob.
    """
    info = read_bootstrap_info(data, max_bootstrap_bytes=max_bootstrap_bytes)
    reader = _Reader(data, info, ci_arrays, blob_digests)
    with gc_paused():  # about ten objects per entry and no cycles
        entries, first_name, ranges = reader.walk()
    del reader  # its tables are as big as a tenth of the index: not held while the prefetch list is made
    prefetch: list[str] = []
    if not info.prefetch_nids:
        return LayerIndex(format="nydus", entries=tuple(entries), blobs=tuple(b.blob_id for b in info.blobs))
    index_of = {e.name: i for i, e in enumerate(entries)}
    emitted: set[int] = set()
    jump: dict[int, int] = {}  # start -> end of subtrees already expanded, so each index is visited once
    for nid in info.prefetch_nids:
        name = first_name.get(nid)
        if name is None:
            raise FormatError(f"nydus bootstrap: prefetch table names nid {nid}, which is not in the tree")
        start = index_of[name]
        start, end = ranges.get(nid, (start, start + 1))
        i = start
        while i < end:
            if i in jump:
                i = jump[i]
                continue
            if entries[i].type is _REG and i not in emitted:
                emitted.add(i)
                prefetch.append(entries[i].name)
            i += 1
        jump[start] = max(end, jump.get(start, end))
    return LayerIndex(format="nydus", entries=tuple(entries), blobs=tuple(b.blob_id for b in info.blobs),
                      prefetch=tuple(prefetch))


def __getattr__(name: str) -> Any:
    # The writer's names, imported on first use: the daemon and the mount processes only read
    # bootstraps, and the writer is 0.5 MiB of each one's memory.
    if name in ("NydusResult", "write_nydus"):
        from snapshotter.formats import rafs_writer

        value = getattr(rafs_writer, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
