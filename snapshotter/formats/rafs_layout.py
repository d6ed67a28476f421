"""Nydus RAFS v6 on-disk constants and fixed-size records (see shared FORMATS.md section 1).

Pure packing/unpacking: `unpack_*` take bytes that are already known to be long enough (the
caller bounds-checks offsets) and return plain tuples/dataclasses; `pack_*` produce the exact
record bytes. All integers are little-endian.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from snapshotter.formats.index import Compression

EROFS_MAGIC = 0xE0F5E1E2
SB_OFFSET = 1024
EXT_SB_OFFSET = 1152
DEVT_OFFSET = 1408
DEVT_SLOTOFF = DEVT_OFFSET // 128
DEVT_SIZE = 128
BLOB_ENTRY_SIZE = 256
CHUNK_INFO_SIZE = 80
CHUNK_INDEX_SIZE = 8
DIRENT_SIZE = 12
INODE_SLOT = 32
COMPACT_INODE_SIZE = 32
EXTENDED_INODE_SIZE = 64
XATTR_IBODY_HEADER = 12
XATTR_ENTRY_HEADER = 4

FEATURE_COMPAT_RAFS_V6 = 0x4000_0000
FEATURE_INCOMPAT_CHUNKED_FILE = 0x4
FEATURE_INCOMPAT_DEVICE_TABLE = 0x8
RAFS_V6_INCOMPAT = FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE

# RafsSuperFlags (ext SB s_flags)
FLAG_COMP_NONE = 0x1
FLAG_COMP_LZ4_BLOCK = 0x2
FLAG_HASH_BLAKE3 = 0x4
FLAG_HASH_SHA256 = 0x8
FLAG_EXPLICIT_UID_GID = 0x10
FLAG_HAS_XATTR = 0x20
FLAG_COMP_GZIP = 0x40
FLAG_COMP_ZSTD = 0x80
FLAG_INLINED_CHUNK_DIGEST = 0x100
FLAG_TARFS_MODE = 0x200

COMP_FLAGS = {
    Compression.NONE: FLAG_COMP_NONE,
    Compression.LZ4_BLOCK: FLAG_COMP_LZ4_BLOCK,
    Compression.GZIP: FLAG_COMP_GZIP,
    Compression.ZSTD: FLAG_COMP_ZSTD,
}
HASH_FLAGS = {"blake3": FLAG_HASH_BLAKE3, "sha256": FLAG_HASH_SHA256}

# Blob table compression_algo / digest_algo codes
BLOB_COMPRESSION = {0: Compression.NONE, 1: Compression.LZ4_BLOCK, 2: Compression.GZIP, 3: Compression.ZSTD}
BLOB_COMPRESSION_CODE = {v: k for k, v in BLOB_COMPRESSION.items()}
BLOB_DIGEST = {0: "blake3", 1: "sha256"}
BLOB_DIGEST_CODE = {v: k for k, v in BLOB_DIGEST.items()}

# BlobFeatures
BLOB_ALIGNED = 0x1
BLOB_CHUNK_INFO_V2 = 0x4
BLOB_ZRAN = 0x8
BLOB_INLINED_CHUNK_DIGEST = 0x20
BLOB_TARFS = 0x40
BLOB_BATCH = 0x80
BLOB_ENCRYPTED = 0x100
BLOB_HAS_TAR_HEADER = 0x1000_0000
BLOB_HAS_TOC = 0x2000_0000
BLOB_CAP_TAR_TOC = 0x4000_0000

# Chunk-info flags (bootstrap chunk table)
CHUNK_COMPRESSED = 0x1
CHUNK_HOLE = 0x2
CHUNK_ENCRYPTED = 0x4
CHUNK_BATCH = 0x8

# Inode i_format
LAYOUT_FLAT_PLAIN = 0
LAYOUT_FLAT_INLINE = 2
LAYOUT_CHUNK_BASED = 4
CHUNK_FORMAT_INDEXES = 0x20
CHUNK_FORMAT_BLKBITS_MASK = 0x1F
EROFS_NULL_ADDR = 0xFFFF_FFFF

# Dirent file types
FT_UNKNOWN, FT_REG, FT_DIR, FT_CHR, FT_BLK, FT_FIFO, FT_SOCK, FT_SYMLINK = range(8)

# Xattr name index -> prefix. Index 2/3 name the whole attribute (suffix is empty).
XATTR_PREFIXES = {
    1: "user.",
    2: "system.posix_acl_access",
    3: "system.posix_acl_default",
    4: "trusted.",
    6: "security.",
}

S_IFMT = 0o170000
S_IFSOCK = 0o140000
S_IFLNK = 0o120000
S_IFREG = 0o100000
S_IFBLK = 0o060000
S_IFDIR = 0o040000
S_IFCHR = 0o020000
S_IFIFO = 0o010000

_SB = struct.Struct("<IIIBBHQQIIII16s16sIHHH38s")
_EXT_SB = struct.Struct("<QQIIQQQII200s")
_DEVT = struct.Struct("<64sII56s")
_BLOB = struct.Struct("<64sIIIIIIQQIIQQQ32s32sQ8sI36s")
_COMPACT = struct.Struct("<HHHHIIIIHH4s")
_EXTENDED = struct.Struct("<HHHHQIIIIQII16s")
_CHUNK_INFO = struct.Struct("<32sIIIIQQQII")
_CHUNK_INDEX = struct.Struct("<HHI")
_DIRENT = struct.Struct("<QHBB")
assert _SB.size == 128 and _EXT_SB.size == 256 and _DEVT.size == 128 and _BLOB.size == 256
assert _COMPACT.size == 32 and _EXTENDED.size == 64 and _CHUNK_INFO.size == 80


@dataclass(frozen=True, slots=True)
class SuperBlock:
    checksum: int
    feature_compat: int
    blkszbits: int
    extslots: int
    root_nid: int
    inos: int
    build_time: int
    build_time_nsec: int
    blocks: int
    meta_blkaddr: int
    xattr_blkaddr: int
    feature_incompat: int
    extra_devices: int
    devt_slotoff: int


def unpack_sb(b: bytes) -> tuple[int, SuperBlock]:
    """(magic, superblock) from the 128 bytes at SB_OFFSET."""
    (magic, checksum, compat, blkszbits, extslots, root_nid, inos, build_time, build_nsec, blocks,
     meta_blkaddr, xattr_blkaddr, _uuid, _vol, incompat, _u, extra_devices, devt_slotoff,
     _res) = _SB.unpack(b)
    return magic, SuperBlock(checksum, compat, blkszbits, extslots, root_nid, inos, build_time, build_nsec,
                             blocks, meta_blkaddr, xattr_blkaddr, incompat, extra_devices, devt_slotoff)


def pack_sb(sb: SuperBlock) -> bytes:
    return _SB.pack(EROFS_MAGIC, sb.checksum, sb.feature_compat, sb.blkszbits, sb.extslots, sb.root_nid,
                    sb.inos, sb.build_time, sb.build_time_nsec, sb.blocks, sb.meta_blkaddr, sb.xattr_blkaddr,
                    b"", b"", sb.feature_incompat, 0, sb.extra_devices, sb.devt_slotoff, b"")


@dataclass(frozen=True, slots=True)
class ExtSuperBlock:
    flags: int
    blob_table_offset: int
    blob_table_size: int
    chunk_size: int
    chunk_table_offset: int
    chunk_table_size: int
    prefetch_table_offset: int
    prefetch_table_size: int


def unpack_ext_sb(b: bytes) -> ExtSuperBlock:
    (flags, bto, bts, cs, cto, cts, pto, pts, _pad, _res) = _EXT_SB.unpack(b)
    return ExtSuperBlock(flags, bto, bts, cs, cto, cts, pto, pts)


def pack_ext_sb(e: ExtSuperBlock) -> bytes:
    return _EXT_SB.pack(e.flags, e.blob_table_offset, e.blob_table_size, e.chunk_size, e.chunk_table_offset,
                        e.chunk_table_size, e.prefetch_table_offset, e.prefetch_table_size, 0, b"")


def pack_device(blob_id: str, blocks: int, mapped_blkaddr: int) -> bytes:
    return _DEVT.pack(blob_id.encode("ascii"), blocks, mapped_blkaddr, b"")


@dataclass(frozen=True, slots=True)
class BlobEntry:
    """One `RafsV6Blob` record of the bootstrap's blob table."""

    blob_id: str
    blob_index: int
    chunk_size: int
    chunk_count: int
    compression_algo: int
    digest_algo: int
    features: int
    compressed_size: int
    uncompressed_size: int
    toc_size: int
    ci_compressor: int
    ci_offset: int
    ci_compressed_size: int
    ci_uncompressed_size: int
    toc_digest: bytes
    meta_digest: bytes = b"\x00" * 32
    meta_size: int = 0
    cipher_algo: int = 0


def unpack_blob(b: bytes) -> tuple[bytes, BlobEntry]:
    """(raw id bytes, entry); the id is left for the caller to validate."""
    (raw_id, index, chunk_size, count, comp, dig, features, csize, usize, toc_size, ci_comp, ci_off,
     ci_csize, ci_usize, toc_digest, meta_digest, meta_size, _iv, cipher, _res) = _BLOB.unpack(b)
    entry = BlobEntry("", index, chunk_size, count, comp, dig, features, csize, usize, toc_size, ci_comp,
                      ci_off, ci_csize, ci_usize, toc_digest, meta_digest, meta_size, cipher)
    return raw_id, entry


def pack_blob(e: BlobEntry) -> bytes:
    return _BLOB.pack(e.blob_id.encode("ascii"), e.blob_index, e.chunk_size, e.chunk_count, e.compression_algo,
                      e.digest_algo, e.features, e.compressed_size, e.uncompressed_size, e.toc_size,
                      e.ci_compressor, e.ci_offset, e.ci_compressed_size, e.ci_uncompressed_size, e.toc_digest,
                      e.meta_digest, e.meta_size, b"", e.cipher_algo, b"")


# A value, like index.Entry: nothing changes one after it is made. Not declared frozen only for
# speed: a parse makes one per inode (11,400 for the bench's image) and a frozen dataclass's
# __init__ costs four times as much (15 ms against 4 ms for those). Hashing is by value.
@dataclass(slots=True, unsafe_hash=True)
class Inode:
    """A parsed on-disk inode (compact or extended).

    For a compact inode `mtime` holds bytes 12-15, which Linux (checked on 6.18) reads as seconds
    after the superblock build time (nydus writes 0 there and its own reader reports 0);
    mtime_nsec is then 0 and the build time's nanoseconds apply."""

    extended: bool
    layout: int
    xattr_icount: int
    mode: int
    nlink: int
    size: int
    i_u: int
    ino: int
    uid: int
    gid: int
    mtime: int
    mtime_nsec: int

    @property
    def inode_size(self) -> int:
        return EXTENDED_INODE_SIZE if self.extended else COMPACT_INODE_SIZE

    @property
    def xattr_size(self) -> int:
        return 0 if self.xattr_icount == 0 else XATTR_IBODY_HEADER + (self.xattr_icount - 1) * 4


def unpack_inode(b: bytes) -> Inode:
    """Parse an inode from `b` (>= 32 bytes; >= 64 if the format bit says extended)."""
    return unpack_inode_at(b, 0)


def unpack_inode_at(b: bytes, off: int) -> Inode:
    """Parse the inode at `b[off:]` without copying it out (struct.error when `b` ends first)."""
    fmt = b[off] | b[off + 1] << 8
    layout = (fmt >> 1) & 0x7
    if fmt & 1:
        (_f, icount, mode, _r, size, i_u, ino, uid, gid, mtime, nsec, nlink, _res) = _EXTENDED.unpack_from(b, off)
        return Inode(True, layout, icount, mode, nlink, size, i_u, ino, uid, gid, mtime, nsec)
    (_f, icount, mode, nlink, size, rel_mtime, i_u, ino, uid, gid, _res2) = _COMPACT.unpack_from(b, off)
    return Inode(False, layout, icount, mode, nlink, size, i_u, ino, uid, gid, rel_mtime, 0)


def pack_extended_inode(*, layout: int, xattr_icount: int, mode: int, size: int, i_u: int, ino: int,
                        uid: int, gid: int, mtime: int, mtime_nsec: int, nlink: int) -> bytes:
    fmt = 1 | (layout << 1)
    return _EXTENDED.pack(fmt, xattr_icount, mode, 0, size, i_u, ino, uid, gid, mtime, mtime_nsec, nlink, b"")


def pack_compact_inode(*, layout: int, xattr_icount: int, mode: int, size: int, i_u: int, ino: int,
                       uid: int, gid: int, nlink: int, rel_mtime: int = 0) -> bytes:
    """A 32-byte compact inode; its mtime is the superblock build time + rel_mtime seconds."""
    fmt = layout << 1
    return _COMPACT.pack(fmt, xattr_icount, mode, nlink, size, rel_mtime, i_u, ino, uid, gid, b"")


def iter_chunk_indexes(b: bytes) -> Iterator[tuple[int, int, int]]:
    """(blob_addr_lo, blob_addr_hi, blkaddr) of each chunk index in `b` (a multiple of 8 bytes)."""
    return _CHUNK_INDEX.iter_unpack(b)


def pack_chunk_index(blob_index: int, ci_index: int, blkaddr: int) -> bytes:
    lo = ci_index & 0xFFFF
    hi = ((blob_index + 1) & 0xFF) | (((ci_index >> 16) & 0xFF) << 8)
    return _CHUNK_INDEX.pack(lo, hi, blkaddr)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One `RafsV5ChunkInfo` record (bootstrap chunk table) or a decoded blob CI entry."""

    digest: bytes
    blob_index: int
    flags: int
    compressed_size: int
    uncompressed_size: int
    compressed_offset: int
    uncompressed_offset: int
    file_offset: int
    index: int
    crc32: int = 0


def unpack_chunk_info(b: bytes, off: int) -> ChunkInfo:
    (digest, blob_index, flags, csize, usize, coff, uoff, foff, index, crc) = _CHUNK_INFO.unpack_from(b, off)
    return ChunkInfo(digest, blob_index, flags, csize, usize, coff, uoff, foff, index, crc)


def chunk_info_fields(b: bytes, off: int) -> tuple[Any, ...]:
    """The fields of the chunk table record at `b[off:]`, in ChunkInfo order, as a plain tuple
    (what a parse that checks and drops each record needs, without making a ChunkInfo)."""
    return _CHUNK_INFO.unpack_from(b, off)


def pack_chunk_info(c: ChunkInfo) -> bytes:
    return _CHUNK_INFO.pack(c.digest, c.blob_index, c.flags, c.compressed_size, c.uncompressed_size,
                            c.compressed_offset, c.uncompressed_offset, c.file_offset, c.index, c.crc32)


def unpack_dirent(b: bytes, off: int) -> tuple[int, int, int]:
    """(nid, nameoff, file_type)."""
    nid, nameoff, ftype, _r = _DIRENT.unpack_from(b, off)
    return nid, nameoff, ftype


def pack_dirent(nid: int, nameoff: int, file_type: int) -> bytes:
    return _DIRENT.pack(nid, nameoff, file_type, 0)


def decode_ci_v1(b: bytes, off: int) -> tuple[int, int, int, int]:
    """A blob CI v1 entry -> (uncompressed_offset, uncompressed_size, compressed_offset, compressed_size)."""
    uinfo = int.from_bytes(b[off:off + 8], "little")
    cinfo = int.from_bytes(b[off + 8:off + 16], "little")
    uoff = uinfo & 0xFFF_FFFF_F000
    usize = ((uinfo >> 44) | (((uinfo >> 8) & 0xF) << 20)) + 1
    coff = cinfo & 0xFF_FFFF_FFFF
    csize = ((cinfo >> 44) | (((cinfo >> 40) & 0xF) << 20)) + 1
    return uoff, usize, coff, csize


def encode_ci_v1(uoff: int, usize: int, coff: int, csize: int) -> bytes:
    u1, c1 = usize - 1, csize - 1
    uinfo = (uoff & 0xFFF_FFFF_F000) | ((u1 & 0xFFFFF) << 44) | (((u1 >> 20) & 0xF) << 8)
    cinfo = (coff & 0xFF_FFFF_FFFF) | ((c1 & 0xFFFFF) << 44) | (((c1 >> 20) & 0xF) << 40)
    return uinfo.to_bytes(8, "little") + cinfo.to_bytes(8, "little")


def decode_ci_v2(b: bytes, off: int) -> tuple[int, int, int, int, int]:
    """A blob CI v2 entry -> (uoffset, usize, coffset, csize, flags)."""
    uinfo = int.from_bytes(b[off:off + 8], "little")
    cinfo = int.from_bytes(b[off + 8:off + 16], "little")
    uoff = (uinfo & 0xFFFF_FFFF) << 12
    usize = ((uinfo >> 32) & 0xFF_FFFF) + 1
    flags = uinfo >> 56
    coff = cinfo & 0xFF_FFFF_FFFF
    csize = cinfo >> 40
    return uoff, usize, coff, csize, flags


def encode_dev(major: int, minor: int) -> int:
    """Linux new_encode_dev: the 32-bit rdev the kernel's erofs decodes from i_u."""
    return (minor & 0xFF) | ((major & 0xFFF) << 8) | ((minor & ~0xFF) << 12)


def decode_dev(dev: int) -> tuple[int, int]:
    """Linux new_decode_dev."""
    return (dev & 0xFFF00) >> 8, (dev & 0xFF) | ((dev >> 12) & 0xFFF00)
