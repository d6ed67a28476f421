"""Lay out and serialize a RAFS v6 bootstrap from the writer's merged tree.

Layout (block size 4 KiB): zeros | EROFS SB @1024 | RAFS ext SB @1152 | device table @1408 |
blob table (4 KiB aligned) | prefetch table | metadata area: one empty block, then every inode
(extended, 32-byte aligned; xattrs, then the inline tail of a directory/symlink or the chunk
index array of a regular file) | full data blocks of directories/symlinks | chunk-info table |
padding to 4 KiB.

Metadata-only images (`metadata_only=True`, used for overlayfs metacopy lower layers): every
regular file is chunk-based with one chunk as large as the file and a 4-byte block map entry
EROFS_NULL_ADDR, so it has its size but no data (a read gives zeros); there are no blobs.

Placement rules the kernel relies on: an inode and its xattrs never straddle a block when they
fit in one; an inline tail is in the same block as its inode (else the layout is FLAT_PLAIN
and the tail gets its own block); a dirent and its name never straddle a block.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING

from snapshotter.errors import FormatError
from snapshotter.formats import rafs_layout as L
from snapshotter.formats.index import Compression, normalize_name

if TYPE_CHECKING:
    from snapshotter.formats.rafs_writer import _Node, _StoredChunk

BS = 4096
_BLKBITS = 12


_BLOCK_MAP_ENTRY = 4  # an EROFS block map entry: a 32-bit block address (chunk-based without INDEXES)
_MAX_CHUNK_BITS = _BLKBITS + 31  # the chunk format's 5 bits of chunk size above the block size


def _hole_chunk_bits(size: int) -> int:
    """log2 of the chunk size that covers a file of `size` bytes in one chunk (at least a block)."""
    bits = max(_BLKBITS, (size - 1).bit_length())
    if bits > _MAX_CHUNK_BITS:
        raise FormatError(f"a file of {size} bytes is too large for an EROFS metadata image")
    return bits


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _ftype(mode: int) -> int:
    fmt = stat.S_IFMT(mode)
    return {
        stat.S_IFREG: L.FT_REG, stat.S_IFDIR: L.FT_DIR, stat.S_IFCHR: L.FT_CHR, stat.S_IFBLK: L.FT_BLK,
        stat.S_IFIFO: L.FT_FIFO, stat.S_IFSOCK: L.FT_SOCK, stat.S_IFLNK: L.FT_SYMLINK,
    }[fmt]


def encode_xattrs(xattrs: dict[str, bytes]) -> bytes:
    """The inline xattr area (header + entries), or b"" when there are none."""
    if not xattrs:
        return b""
    out = bytearray(L.XATTR_IBODY_HEADER)
    for name in sorted(xattrs):
        value = xattrs[name]
        for index, prefix in L.XATTR_PREFIXES.items():
            whole = index in (2, 3)
            if (whole and name == prefix) or (not whole and name.startswith(prefix) and name != prefix):
                suffix = name[len(prefix):].encode("utf-8", "surrogateescape")
                break
        else:
            raise FormatError(f"xattr {name!r} has a prefix RAFS v6 cannot store")
        if len(suffix) > 255 or len(value) > 0xFFFF:
            raise FormatError(f"xattr {name!r} is too long for RAFS v6")
        entry = bytes([len(suffix), index]) + len(value).to_bytes(2, "little") + suffix + value
        out += entry + b"\x00" * (-len(entry) % 4)
    if (len(out) - L.XATTR_IBODY_HEADER) // 4 + 1 > 0xFFFF:
        raise FormatError("xattrs too large for one RAFS v6 inode")
    return bytes(out)


def _dir_blocks(names: list[bytes]) -> tuple[list[list[bytes]], int]:
    """Split sorted dirent names into blocks; returns (blocks, directory size in bytes)."""
    blocks: list[list[bytes]] = [[]]
    used = 0
    for name in names:
        need = L.DIRENT_SIZE + len(name)
        if used + need > BS:
            blocks.append([])
            used = 0
        blocks[-1].append(name)
        used += need
    return blocks, (len(blocks) - 1) * BS + used


class _Inode:
    __slots__ = ("node", "nid", "offset", "xattrs", "layout", "size", "tail", "raw_blkaddr", "nlink",
                 "parent", "names", "blocks", "ino", "compact")

    def __init__(self, node: _Node, ino: int) -> None:
        self.node = node
        self.ino = ino
        self.nid = 0
        self.offset = 0
        self.xattrs = encode_xattrs(node.xattrs)
        self.layout = L.LAYOUT_FLAT_PLAIN
        self.size = node.size
        self.tail = 0
        self.raw_blkaddr = 0
        self.nlink = 0
        self.parent: _Inode | None = None
        self.names: list[tuple[bytes, _Inode]] = []
        self.blocks: list[list[bytes]] = []
        self.compact = False


def build_bootstrap(root: _Node, blobs: Sequence[L.BlobEntry], *, chunk_size: int, compression: Compression,
                    digest_algo: str, prefetch: Sequence[str], compact_inodes: bool = False,
                    metadata_only: bool = False) -> bytes:
    """The bootstrap bytes. compact_inodes: use 32-byte inodes where ids, nlink, size and mtime
    allow (mtime as seconds after the build time, the oldest mtime with the most common
    nanoseconds); nydusd itself ignores compact mtimes, the kernel does not. metadata_only:
    regular files are holes of their size (see the module docstring); `blobs` must be empty
    and the nodes' chunks are ignored."""
    if metadata_only and blobs:
        raise ValueError("a metadata-only image has no blobs")
    # 1. Inodes in DFS preorder; a node reached twice (hard link) keeps its first inode.
    inodes: list[_Inode] = []
    by_id: dict[int, _Inode] = {}
    paths: dict[str, _Inode] = {}
    stack: list[tuple[_Node, _Inode | None, str]] = [(root, None, "")]
    while stack:
        node, parent, path = stack.pop()
        known = by_id.get(id(node))
        if known is not None:
            known.nlink += 1
            paths[path] = known
            continue
        ino = _Inode(node, len(inodes) + 1)
        by_id[id(node)] = ino
        inodes.append(ino)
        paths[path] = ino
        ino.nlink = 1
        ino.parent = parent or ino
        if node.is_dir:
            children = sorted(node.children.items())
            for name, child in reversed(children):
                if prefetch:  # paths are only needed to find the prefetch table's inodes
                    child_path = f"{path}/{name.decode('utf-8', 'surrogateescape')}" if path else name.decode(
                        "utf-8", "surrogateescape")
                else:
                    child_path = ""
                stack.append((child, ino, child_path))
    for ino in inodes:
        if ino.node.is_dir:
            subdirs = sum(1 for c in ino.node.children.values() if c.is_dir)
            ino.nlink = 2 + subdirs
            names = sorted([b".", b".."] + list(ino.node.children))
            ino.blocks, ino.size = _dir_blocks(names)
    child_inode = {id(i.node): i for i in inodes}
    build_time, build_nsec = 0, 0
    if compact_inodes:
        nsecs: dict[int, int] = {}
        for ino in inodes:
            nsecs[ino.node.mtime_nsec] = nsecs.get(ino.node.mtime_nsec, 0) + 1
        build_nsec = max(nsecs, key=lambda k: nsecs[k])
        build_time = min(i.node.mtime for i in inodes if i.node.mtime_nsec == build_nsec)
        for ino in inodes:
            n = ino.node
            ino.compact = (n.uid <= 0xFFFF and n.gid <= 0xFFFF and ino.nlink <= 0xFFFF and ino.size < 1 << 32
                           and n.mtime_nsec == build_nsec and 0 <= n.mtime - build_time < 1 << 32)

    # 2. Fixed tables.
    n_blobs = len(blobs)
    blob_table_offset = _round_up(L.DEVT_OFFSET + L.DEVT_SIZE * n_blobs, BS)
    prefetch_inodes = [paths[normalize_name(p)] for p in prefetch if normalize_name(p) in paths]
    prefetch_offset = blob_table_offset + L.BLOB_ENTRY_SIZE * n_blobs
    meta_blkaddr = _round_up(prefetch_offset + 4 * len(prefetch_inodes), BS) // BS
    meta_base = meta_blkaddr * BS

    # 3. Place inodes.
    cursor = meta_base + BS
    for ino in inodes:
        cursor = _round_up(cursor, L.INODE_SLOT)
        head = (L.COMPACT_INODE_SIZE if ino.compact else L.EXTENDED_INODE_SIZE) + len(ino.xattrs)
        node = ino.node
        flat = node.is_dir or stat.S_ISLNK(node.mode)
        tail = ino.size % BS if flat else 0
        need = head + tail
        if need <= BS and cursor % BS + need > BS:
            cursor = _round_up(cursor, BS)
        ino.offset = cursor
        ino.nid = (cursor - meta_base) // L.INODE_SLOT
        cursor += head
        if flat:
            if tail and need <= BS:
                ino.layout = L.LAYOUT_FLAT_INLINE
                ino.tail = tail
                cursor += tail
        elif stat.S_ISREG(node.mode):
            ino.layout = L.LAYOUT_CHUNK_BASED
            if metadata_only:
                cursor = _round_up(cursor, _BLOCK_MAP_ENTRY) + (_BLOCK_MAP_ENTRY if ino.size else 0)
            else:
                cursor = _round_up(cursor, 8) + L.CHUNK_INDEX_SIZE * len(node.chunks)
    if inodes[0].nid > 0xFFFF:
        raise FormatError("root nid does not fit the superblock")

    # 4. Data blocks of directories and symlinks.
    block = _round_up(cursor, BS) // BS
    for ino in inodes:
        if ino.node.is_dir or stat.S_ISLNK(ino.node.mode):
            full = (ino.size - ino.tail) // BS if ino.layout == L.LAYOUT_FLAT_INLINE else -(-ino.size // BS)
            if full:
                ino.raw_blkaddr = block
                block += full
    chunk_table_offset = block * BS
    unique: dict[tuple[int, int], _StoredChunk] = {}
    for ino in inodes:
        for c in ino.node.chunks:
            unique[(c.blob_index, c.ci_index)] = c
    table = sorted(unique.values(), key=lambda c: (c.digest, c.blob_index + 1))
    chunk_table_size = L.CHUNK_INFO_SIZE * len(table)
    total = _round_up(chunk_table_offset + chunk_table_size, BS)
    out = bytearray(total)

    # 5. Serialize.
    has_xattr = False
    for ino in inodes:
        node = ino.node
        has_xattr |= bool(ino.xattrs)
        if node.is_dir or stat.S_ISLNK(node.mode):
            i_u = ino.raw_blkaddr
        elif stat.S_ISREG(node.mode) and metadata_only:
            i_u = _hole_chunk_bits(ino.size) - _BLKBITS  # a block map (no INDEXES flag) of one chunk
        elif stat.S_ISREG(node.mode):
            i_u = L.CHUNK_FORMAT_INDEXES | ((chunk_size.bit_length() - 1) - _BLKBITS)
        elif stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
            i_u = node.rdev
        else:
            i_u = 0
        icount = 0 if not ino.xattrs else (len(ino.xattrs) - L.XATTR_IBODY_HEADER) // 4 + 1
        if ino.compact:
            rec = L.pack_compact_inode(layout=ino.layout, xattr_icount=icount, mode=node.mode, size=ino.size,
                                       i_u=i_u, ino=ino.ino, uid=node.uid, gid=node.gid, nlink=ino.nlink,
                                       rel_mtime=node.mtime - build_time)
        else:
            rec = L.pack_extended_inode(layout=ino.layout, xattr_icount=icount, mode=node.mode, size=ino.size,
                                        i_u=i_u, ino=ino.ino, uid=node.uid, gid=node.gid, mtime=node.mtime,
                                        mtime_nsec=node.mtime_nsec, nlink=ino.nlink)
        pos = ino.offset
        out[pos:pos + len(rec)] = rec
        pos += len(rec)
        out[pos:pos + len(ino.xattrs)] = ino.xattrs
        pos += len(ino.xattrs)
        if stat.S_ISREG(node.mode) and metadata_only:
            if ino.size:
                pos = _round_up(pos, _BLOCK_MAP_ENTRY)
                out[pos:pos + _BLOCK_MAP_ENTRY] = L.EROFS_NULL_ADDR.to_bytes(_BLOCK_MAP_ENTRY, "little")
            continue
        if stat.S_ISREG(node.mode):
            pos = _round_up(pos, 8)
            for c in node.chunks:
                out[pos:pos + 8] = L.pack_chunk_index(c.blob_index, c.ci_index, c.uncompressed_offset // BS)
                pos += 8
            continue
        if node.is_dir:
            body = _dir_body(ino, child_inode)
        elif stat.S_ISLNK(node.mode):
            body = node.target
        else:
            continue
        head_len = len(body) - ino.tail
        if head_len:
            start = ino.raw_blkaddr * BS
            out[start:start + head_len] = body[:head_len]
        if ino.tail:
            out[pos:pos + ino.tail] = body[head_len:]

    for i, c in enumerate(table):
        rec = L.pack_chunk_info(L.ChunkInfo(
            digest=c.digest, blob_index=c.blob_index, flags=L.CHUNK_COMPRESSED if c.compressed else 0,
            compressed_size=c.compressed_size, uncompressed_size=c.uncompressed_size,
            compressed_offset=c.compressed_offset, uncompressed_offset=c.uncompressed_offset, file_offset=0,
            index=c.ci_index))
        off = chunk_table_offset + i * L.CHUNK_INFO_SIZE
        out[off:off + L.CHUNK_INFO_SIZE] = rec

    mapped = _round_up(total, 512 << 10) // BS
    for i, b in enumerate(blobs):
        blocks = b.uncompressed_size // BS
        off = L.DEVT_OFFSET + i * L.DEVT_SIZE
        out[off:off + L.DEVT_SIZE] = L.pack_device(b.blob_id, blocks, mapped)
        mapped += blocks
        off = blob_table_offset + i * L.BLOB_ENTRY_SIZE
        out[off:off + L.BLOB_ENTRY_SIZE] = L.pack_blob(b)
    for i, ino in enumerate(prefetch_inodes):
        off = prefetch_offset + 4 * i
        out[off:off + 4] = ino.nid.to_bytes(4, "little")

    flags = (L.COMP_FLAGS[compression] | L.HASH_FLAGS[digest_algo] | L.FLAG_EXPLICIT_UID_GID
             | L.FLAG_INLINED_CHUNK_DIGEST | (L.FLAG_HAS_XATTR if has_xattr else 0))
    out[L.EXT_SB_OFFSET:L.EXT_SB_OFFSET + 256] = L.pack_ext_sb(L.ExtSuperBlock(
        flags=flags, blob_table_offset=blob_table_offset, blob_table_size=L.BLOB_ENTRY_SIZE * n_blobs,
        chunk_size=chunk_size, chunk_table_offset=chunk_table_offset if table else 0,
        chunk_table_size=chunk_table_size, prefetch_table_offset=prefetch_offset if prefetch_inodes else 0,
        prefetch_table_size=4 * len(prefetch_inodes)))
    out[L.SB_OFFSET:L.SB_OFFSET + 128] = L.pack_sb(L.SuperBlock(
        checksum=0, feature_compat=L.FEATURE_COMPAT_RAFS_V6, blkszbits=_BLKBITS, extslots=0,
        root_nid=inodes[0].nid, inos=len(inodes), build_time=build_time, build_time_nsec=build_nsec,
        blocks=sum(b.uncompressed_size // BS for b in blobs), meta_blkaddr=meta_blkaddr, xattr_blkaddr=0,
        feature_incompat=L.RAFS_V6_INCOMPAT, extra_devices=n_blobs, devt_slotoff=L.DEVT_SLOTOFF))
    return bytes(out)


def _dir_body(ino: _Inode, child_inode: dict[int, _Inode]) -> bytes:
    """The directory's dirent blocks (full blocks padded with zeros, last one unpadded)."""
    node = ino.node
    parent = ino.parent or ino
    out = bytearray()
    for bi, names in enumerate(ino.blocks):
        start = len(out)
        nameoff = L.DIRENT_SIZE * len(names)
        heads = bytearray()
        tails = bytearray()
        for name in names:
            if name == b".":
                target = ino
            elif name == b"..":
                target = parent
            else:
                target = child_inode[id(node.children[name])]
            heads += L.pack_dirent(target.nid, nameoff, _ftype(target.node.mode))
            tails += name
            nameoff += len(name)
        out += heads + tails
        if bi + 1 < len(ino.blocks):
            out += b"\x00" * (BS - (len(out) - start))
    if len(out) != ino.size:
        raise AssertionError(f"directory size {len(out)} != planned {ino.size}")
    return bytes(out)
