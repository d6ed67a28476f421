"""Write a Nydus RAFS v6 image: one bootstrap over N layer tars, one data blob per layer.

Contract of `write_nydus(layers, blob_out, chunk_size=1 MiB, compression="zstd", prefetch=None)`:
- `layers` are readable layer tar streams (any tarfile-readable compression), lowest first.
  They are merged the way a container runtime applies them: a `.wh.NAME` deletes NAME from the
  tree built so far, `.wh..wh..opq` empties its directory of everything not added by the same
  layer; whiteout entries themselves are not in the image. Missing parents are created 0755.
- `blob_out(i)` is called once per layer, in order, and returns the writable stream that
  receives layer i's blob. Each blob holds the chunks of that layer's regular files that no
  earlier blob (or earlier part of this blob) already holds: chunks are deduplicated by
  digest across all layers. Blob ids are the SHA-256 of the whole blob file.
- Chunk digests are SHA-256 by default (flag HASH_SHA256, blob digest_algo 1): hashlib is fast
  and always present, and the kernel does not look at digests. `digest="blake3"` writes nydus's
  default instead (needs the `blake3` package). Deduplication keys on this digest.
- Blob layout (nydus 2.2 style): chunk data (each chunk one zstd frame / gzip member / raw LZ4
  block, or raw when compressing does not shrink it; uncompressed offsets 4 KiB aligned) |
  tar header "image.blob" | CI v1 array | 4 KiB CI header | tar header "blob.meta" |
  digest array | tar header "blob.digest" | ToC | tar header "rafs.blob.toc".
- The bootstrap uses extended inodes (so mtimes and 32-bit ids survive; `compact_inodes=True`
  uses 32-byte ones where they can hold the same facts for the kernel), block size 4 KiB,
  and carries the chunk-info table, so `parse_bootstrap` needs nothing but the bootstrap.
  `prefetch` names (normalized paths) go to the prefetch table as nids.
- Prefetch files first, as nydus-image lays out a blob: when `prefetch` is given and a layer's
  stream can seek, the chunks of that layer's regular files named in it (or under a directory
  named in it) are written at the head of the blob, before every other chunk, so a mount's
  prefetch is one contiguous run of the blob, streamed in blob order. They are in list order
  (a file at the first position naming it or a directory above it; files of one position in
  tar order) when the tar is uncompressed, in tar order when it is compressed (its data cannot
  be sought). That layer's tar is then read twice (once for those files, once for the tree); a
  stream that cannot seek is read once and its chunks stay in tar order.
The function reads each tar once (but see above), streaming; memory holds the tree, not file
contents.
"""

from __future__ import annotations

import hashlib
import stat
import tarfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

import zstandard

from snapshotter.errors import FormatError
from snapshotter.formats import rafs_layout as L
from snapshotter.formats.digest import compute_digest
from snapshotter.formats.index import OPAQUE_MARKER, WHITEOUT_PREFIX, Compression, normalize_name
from snapshotter.formats.lz4block import compress_block

BLOCK_SIZE = 4096
_BLKBITS = 12
_FIRST_INODE_GAP = BLOCK_SIZE  # like nydus-image: root nid != 0


@dataclass(frozen=True)
class NydusResult:
    """bootstrap: the image bootstrap bytes; blob_ids/blob_sizes: per layer, in order;
    stored_chunks/deduplicated_chunks: how many chunks were written vs. referenced again."""

    bootstrap: bytes = field(repr=False)
    blob_ids: tuple[str, ...]
    blob_sizes: tuple[int, ...]
    stored_chunks: int
    deduplicated_chunks: int


@dataclass
class _Node:
    mode: int  # including S_IFMT
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    mtime_nsec: int = 0
    size: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    target: bytes = b""
    rdev: int = 0
    chunks: list[_StoredChunk] = field(default_factory=list)
    children: dict[bytes, _Node] = field(default_factory=dict)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass(frozen=True)
class _StoredChunk:
    digest: bytes
    blob_index: int
    ci_index: int
    compressed: bool
    compressed_offset: int
    compressed_size: int
    uncompressed_offset: int
    uncompressed_size: int


class _Compressor:
    def __init__(self, compression: Compression) -> None:
        self.compression = compression
        self._zstd = zstandard.ZstdCompressor(level=3) if compression is Compression.ZSTD else None

    def __call__(self, data: bytes) -> bytes:
        if self.compression is Compression.ZSTD:
            assert self._zstd is not None
            return self._zstd.compress(data)
        if self.compression is Compression.GZIP:
            c = zlib.compressobj(6, zlib.DEFLATED, 31)
            return c.compress(data) + c.flush()
        if self.compression is Compression.LZ4_BLOCK:
            return compress_block(data)
        return data


class _BlobWriter:
    """One layer's blob: chunk data first, nydus metadata appended by `finish`."""

    def __init__(self, index: int, out: BinaryIO) -> None:
        self.index = index
        self.out = out
        self.hash = hashlib.sha256()
        self.coff = 0
        self.uoff = 0
        self.chunks: list[_StoredChunk] = []

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.hash.update(data)
        self.coff += len(data)

    def add_chunk(self, digest: bytes, plain_size: int, stored: bytes, compressed: bool) -> _StoredChunk:
        if len(self.chunks) >= 1 << 24:
            raise FormatError(f"layer {self.index}: more than 2^24 chunks in one blob")
        chunk = _StoredChunk(digest, self.index, len(self.chunks), compressed, self.coff, len(stored),
                             self.uoff, plain_size)
        self.write(stored)
        self.uoff += -(-plain_size // BLOCK_SIZE) * BLOCK_SIZE
        self.chunks.append(chunk)
        return chunk

    def finish(self, compression: Compression, chunk_size: int, digest_algo: str) -> L.BlobEntry:
        data_end = self.coff
        self.write(_tar_header("image.blob", data_end))
        image_digest = self.hash.copy().digest()
        ci = b"".join(L.encode_ci_v1(c.uncompressed_offset, c.uncompressed_size, c.compressed_offset,
                                     c.compressed_size) for c in self.chunks)
        ci_offset = self.coff
        features = (L.BLOB_ALIGNED | L.BLOB_INLINED_CHUNK_DIGEST | L.BLOB_HAS_TAR_HEADER | L.BLOB_HAS_TOC
                    | L.BLOB_CAP_TAR_TOC)
        header = _ci_header(features, len(self.chunks), ci_offset, len(ci))
        self.write(ci)
        self.write(bytes(header))
        self.write(_tar_header("blob.meta", len(ci) + 4096))
        digests = b"".join(c.digest for c in self.chunks)
        digest_offset = self.coff
        self.write(digests)
        self.write(_tar_header("blob.digest", len(digests)))
        toc = b"".join([
            # As nydus 2.2 writes it: offset and size both the data length, digest over data + header.
            _toc_raw("image.blob", image_digest, data_end, data_end, self.uoff),
            _toc_entry("blob.meta", ci, ci_offset),
            _toc_entry("blob.meta.header", bytes(header), ci_offset + len(ci)),
            _toc_entry("blob.digest", digests, digest_offset),
        ])
        toc_blob = toc + _tar_header("rafs.blob.toc", len(toc))
        self.write(toc_blob)
        return L.BlobEntry(
            blob_id=self.hash.hexdigest(), blob_index=self.index, chunk_size=chunk_size,
            chunk_count=len(self.chunks), compression_algo=L.BLOB_COMPRESSION_CODE[compression],
            digest_algo=L.BLOB_DIGEST_CODE[digest_algo], features=features, compressed_size=self.coff,
            uncompressed_size=self.uoff, toc_size=len(toc_blob), ci_compressor=0, ci_offset=ci_offset,
            ci_compressed_size=len(ci), ci_uncompressed_size=len(ci),
            toc_digest=hashlib.sha256(toc_blob).digest(),
        )


def _tar_header(name: str, size: int) -> bytes:
    """The 512-byte GNU tar header nydus writes after a blob section (byte-identical to the
    2.2 fixture's): mode/uid/gid left NUL, size and mtime in octal, type '0'."""
    h = bytearray(512)
    h[0:len(name)] = name.encode("ascii")
    h[124:136] = b"%011o\x00" % size
    h[136:148] = b"%011o\x00" % 0
    h[148:156] = b" " * 8
    h[156:157] = b"0"
    h[257:265] = b"ustar  \x00"
    h[148:156] = b"%07o\x00" % sum(h)
    return bytes(h)


def _ci_header(features: int, count: int, ci_offset: int, ci_size: int) -> bytes:
    """The 4 KiB "blob.meta.header" that follows an uncompressed CI array."""
    h = bytearray(4096)
    h[0:4] = (0xB10BB10B).to_bytes(4, "little")
    h[4:8] = features.to_bytes(4, "little")
    h[12:16] = count.to_bytes(4, "little")
    h[16:24] = ci_offset.to_bytes(8, "little")
    h[24:32] = ci_size.to_bytes(8, "little")
    h[32:40] = ci_size.to_bytes(8, "little")
    h[4092:4096] = (0xB10BB10B).to_bytes(4, "little")
    return bytes(h)


def _toc_raw(name: str, digest: bytes, offset: int, csize: int, usize: int) -> bytes:
    e = bytearray(128)
    e[0:4] = (1).to_bytes(4, "little")  # stored uncompressed
    e[8:8 + len(name)] = name.encode("ascii")
    e[24:56] = digest
    e[56:64] = offset.to_bytes(8, "little")
    e[64:72] = csize.to_bytes(8, "little")
    e[72:80] = usize.to_bytes(8, "little")
    return bytes(e)


def _toc_entry(name: str, content: bytes, offset: int) -> bytes:
    return _toc_raw(name, hashlib.sha256(content).digest(), offset, len(content), len(content))


_TAR_MODES = {
    tarfile.REGTYPE: stat.S_IFREG, tarfile.AREGTYPE: stat.S_IFREG, tarfile.CONTTYPE: stat.S_IFREG,
    tarfile.DIRTYPE: stat.S_IFDIR, tarfile.SYMTYPE: stat.S_IFLNK, tarfile.CHRTYPE: stat.S_IFCHR,
    tarfile.BLKTYPE: stat.S_IFBLK, tarfile.FIFOTYPE: stat.S_IFIFO,
}


def _xattrs_of(m: tarfile.TarInfo) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for k, v in m.pax_headers.items():
        if k.startswith("SCHILY.xattr."):
            out[k[len("SCHILY.xattr."):]] = v.encode("utf-8", "surrogateescape")
    return out


class _Builder:
    def __init__(self, blob_out: Callable[[int], BinaryIO], chunk_size: int, compression: Compression,
                 digest_algo: str, prefetch: Sequence[str] = ()) -> None:
        self.blob_out = blob_out
        # Each listed name's first position in the list: the layout order of prefetch files.
        self.prefetch_rank: dict[str, int] = {}
        for position, name in enumerate(prefetch):
            self.prefetch_rank.setdefault(normalize_name(name), position)
        self.digest_algo = digest_algo
        self.chunk_size = chunk_size
        self.compression = compression
        self.compress = _Compressor(compression)
        self.root = _Node(mode=stat.S_IFDIR | 0o755)
        self.dedup: dict[bytes, _StoredChunk] = {}
        self.blobs: list[L.BlobEntry] = []
        self.stored = 0
        self.deduplicated = 0

    # -- tree edits -----------------------------------------------------------------------------
    def _parent(self, parts: list[bytes], create: bool) -> _Node | None:
        node = self.root
        for p in parts[:-1]:
            child = node.children.get(p)
            if child is None or not child.is_dir:
                if not create:
                    return None
                child = _Node(mode=stat.S_IFDIR | 0o755)
                node.children[p] = child
            node = child
        return node

    @staticmethod
    def _split(name: str) -> list[bytes]:
        return [p.encode("utf-8", "surrogateescape") for p in name.split("/")] if name else []

    def _lookup(self, name: str) -> _Node | None:
        node: _Node | None = self.root
        for p in self._split(name):
            if node is None or not node.is_dir:
                return None
            node = node.children.get(p)
        return node

    def _clear_opaque(self, node: _Node, path: str, touched: set[str]) -> None:
        for key in list(node.children):
            child_path = f"{path}/{key.decode('utf-8', 'surrogateescape')}" if path else key.decode(
                "utf-8", "surrogateescape")
            if child_path not in touched:
                del node.children[key]
            elif node.children[key].is_dir:
                self._clear_opaque(node.children[key], child_path, touched)

    # -- layers ---------------------------------------------------------------------------------
    def add_layer(self, index: int, stream: BinaryIO) -> None:
        blob = _BlobWriter(index, self.blob_out(index))
        touched: set[str] = set()
        placed: dict[tuple[int, str], list[_StoredChunk]] = {}
        if self.prefetch_rank and _can_rewind(stream):
            start = stream.tell()
            if _compressed(stream):
                _each_member(index, stream, lambda tf, m: self._place_prefetch_file(tf, m, blob, placed))
            else:
                self._place_prefetch_files_in_list_order(index, stream, start, blob, placed)
            stream.seek(start)
        _each_member(index, stream, lambda tf, m: self._add_member(index, tf, m, blob, touched, placed))
        self.blobs.append(blob.finish(self.compression, self.chunk_size, self.digest_algo))

    def _prefetch_position(self, name: str) -> int | None:
        """The first list position naming `name` or a directory above it (the root "" included);
        None when `name` is not in the prefetch list, itself or under a directory listed there."""
        parts = name.split("/")
        found = [self.prefetch_rank.get("/".join(parts[:i])) for i in range(len(parts) + 1)]
        return min((p for p in found if p is not None), default=None)

    def _place_prefetch_files_in_list_order(self, index: int, stream: BinaryIO, start: int, blob: _BlobWriter,
                                            placed: dict[tuple[int, str], list[_StoredChunk]]) -> None:
        """First pass of an uncompressed, seekable layer tar: find the regular files the prefetch
        list names, then store their chunks in list order (files under one listed directory in
        tar order), each read where its data lies in the tar; keyed as `_place_prefetch_file` keys
        them. A sparse file (PAX sparse headers) is stored as the pass meets it, ahead of the rest."""
        found: list[tuple[int, int, int, int, str]] = []  # (position, tar order, data offset, size, name)

        def note(tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
            if _TAR_MODES.get(m.type) != stat.S_IFREG or m.size <= 0:
                return
            name = normalize_name(m.name)
            position = self._prefetch_position(name)
            if position is None:
                return
            if m.issparse():  # its stored bytes are not its contents: only tarfile reads it right
                self._place_prefetch_file(tf, m, blob, placed)
                return
            found.append((position, len(found), m.offset_data, m.size, name))

        _each_member(index, stream, note)
        for _, _, offset, size, name in sorted(found):
            stream.seek(start + offset)
            placed[(offset, name)] = self._store_data(size, _FullReads(stream), blob)

    def _place_prefetch_file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, blob: _BlobWriter,
                             placed: dict[tuple[int, str], list[_StoredChunk]]) -> None:
        """First pass of a layer: store the chunks of a regular file the prefetch list names,
        keyed by where its data is in the tar (the second pass takes them from there)."""
        if _TAR_MODES.get(m.type) != stat.S_IFREG or m.size <= 0:
            return
        name = normalize_name(m.name)
        if self._prefetch_position(name) is None:
            return
        f = tf.extractfile(m)
        if f is not None:
            placed[(m.offset_data, name)] = self._store_data(m.size, f, blob)

    def _add_member(self, index: int, tf: tarfile.TarFile, m: tarfile.TarInfo, blob: _BlobWriter,
                    touched: set[str], placed: dict[tuple[int, str], list[_StoredChunk]]) -> None:
        name = normalize_name(m.name)
        parts = self._split(name)
        base = parts[-1].decode("utf-8", "surrogateescape") if parts else ""
        if base == OPAQUE_MARKER:
            parent_name = name.rpartition("/")[0]
            parent = self._lookup(parent_name)
            if parent is not None and parent.is_dir:
                self._clear_opaque(parent, parent_name, touched)
            return
        if base.startswith(WHITEOUT_PREFIX):
            parent = self._parent(parts, create=False)
            if parent is not None:
                parent.children.pop(parts[-1][len(WHITEOUT_PREFIX):], None)
            return
        touched.add(name)
        if m.islnk():
            target = self._lookup(normalize_name(m.linkname))
            if target is None or target.is_dir:
                raise FormatError(f"layer {index}: hard link {name!r} -> {m.linkname!r} names no file")
            self._place(parts, target)
            return
        kind = _TAR_MODES.get(m.type)
        if kind is None:
            raise FormatError(f"layer {index}: entry {name!r} has unsupported tar type {m.type!r}")
        if not 0 <= m.uid <= 0xFFFF_FFFF or not 0 <= m.gid <= 0xFFFF_FFFF:
            raise FormatError(f"layer {index}: entry {name!r} has uid/gid beyond 32 bits")
        if not parts and kind != stat.S_IFDIR:
            raise FormatError(f"layer {index}: the root entry is not a directory")
        node = _Node(mode=kind | (m.mode & 0o7777), uid=m.uid, gid=m.gid, xattrs=_xattrs_of(m))
        mtime = max(float(m.mtime), 0.0)  # RAFS stores unsigned seconds
        node.mtime = int(mtime // 1)
        node.mtime_nsec = min(int(round((mtime - node.mtime) * 1e9)), 999_999_999)
        if kind == stat.S_IFREG:
            node.size = m.size
            stored = placed.get((m.offset_data, name))
            if stored is not None:
                node.chunks.extend(stored)
            else:
                f = tf.extractfile(m)
                if f is not None:
                    node.chunks.extend(self._store_data(m.size, f, blob))
        elif kind == stat.S_IFLNK:
            node.target = m.linkname.encode("utf-8", "surrogateescape")
            if not node.target or len(node.target) >= BLOCK_SIZE:
                raise FormatError(f"layer {index}: symlink {name!r} target is empty or too long")
            node.size = len(node.target)
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            node.rdev = L.encode_dev(m.devmajor, m.devminor)
        if not parts:
            node.children = self.root.children
            self.root = node
            return
        self._place(parts, node)

    def _place(self, parts: list[bytes], node: _Node) -> None:
        parent = self._parent(parts, create=True)
        assert parent is not None
        old = parent.children.get(parts[-1])
        if old is not None and old.is_dir and node.is_dir:
            node.children = old.children  # a directory entry updates metadata, keeps contents
        parent.children[parts[-1]] = node

    def _store_data(self, size: int, f: _Readable, blob: _BlobWriter) -> list[_StoredChunk]:
        """The chunks of a file's `size` bytes read from `f`: stored in `blob`, or earlier ones
        holding the same bytes (deduplicated by digest)."""
        chunks: list[_StoredChunk] = []
        left = size
        while left > 0:
            piece = f.read(min(self.chunk_size, left))
            if not piece:
                raise FormatError(f"tar member ended {left} bytes early")
            left -= len(piece)
            digest = bytes.fromhex(compute_digest(self.digest_algo, piece).partition(":")[2])
            known = self.dedup.get(digest)
            if known is not None and known.uncompressed_size == len(piece):
                self.deduplicated += 1
                chunks.append(known)
                continue
            packed = self.compress(piece)
            compressed = len(packed) < len(piece) and self.compression is not Compression.NONE
            chunk = blob.add_chunk(digest, len(piece), packed if compressed else piece, compressed)
            self.stored += 1
            self.dedup[digest] = chunk
            chunks.append(chunk)
        return chunks


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


class _FullReads:
    """A stream whose every read returns as many bytes as asked unless it ends (a raw stream may
    answer short, and `_store_data` cuts chunks by what each read returns)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def read(self, size: int, /) -> bytes:
        out = bytearray()
        while len(out) < size and (piece := self.stream.read(size - len(out))):
            out += piece
        return bytes(out)


_COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")  # gzip, bzip2, xz: what tarfile's "r|*" reads


def _compressed(stream: BinaryIO) -> bool:
    """Whether a seekable tar stream is compressed (its position is kept): its data offsets are
    then offsets in the decompressed tar, not in the stream."""
    at = stream.tell()
    head = stream.read(6)
    stream.seek(at)
    return any(head.startswith(magic) for magic in _COMPRESSED_MAGIC)


def _can_rewind(stream: BinaryIO) -> bool:
    try:
        return stream.seekable()
    except (AttributeError, ValueError, OSError):
        return False


def _each_member(index: int, stream: BinaryIO, visit: Callable[[tarfile.TarFile, tarfile.TarInfo], None]) -> None:
    """Read layer `index`'s tar from `stream` once, calling `visit` on each member in order; a
    stream that is no tar, or a bad one, raises FormatError naming the layer."""
    try:
        tf = tarfile.open(fileobj=stream, mode="r|*")
    except tarfile.TarError as exc:
        raise FormatError(f"layer {index}: not a tar stream: {exc}") from None
    with tf:
        try:
            for m in tf:
                visit(tf, m)
        except tarfile.TarError as exc:
            raise FormatError(f"layer {index}: bad tar: {exc}") from None


def write_nydus(layers: Sequence[BinaryIO], blob_out: Callable[[int], BinaryIO], *,
                chunk_size: int = 1 << 20, compression: str | Compression = "zstd",
                prefetch: Sequence[str] | None = None, compact_inodes: bool = False,
                digest: str = "sha256") -> NydusResult:
    """Build the image bootstrap and one blob per layer (see the module docstring)."""
    comp = Compression(compression)
    if chunk_size < BLOCK_SIZE or chunk_size > 16 << 20 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two in [4 KiB, 16 MiB], not {chunk_size}")
    if not layers:
        raise ValueError("write_nydus needs at least one layer")
    if len(layers) > 255:
        raise ValueError("RAFS v6 chunk indexes address at most 255 blobs")
    if digest not in ("sha256", "blake3"):
        raise ValueError(f"digest must be 'sha256' or 'blake3', not {digest!r}")
    builder = _Builder(blob_out, chunk_size, comp, digest, prefetch or ())
    for i, stream in enumerate(layers):
        builder.add_layer(i, stream)
    from snapshotter.formats.rafs_bootstrap import build_bootstrap

    bootstrap = build_bootstrap(builder.root, builder.blobs, chunk_size=chunk_size, compression=comp,
                                digest_algo=digest, prefetch=prefetch or (), compact_inodes=compact_inodes)
    return NydusResult(bootstrap=bootstrap, blob_ids=tuple(b.blob_id for b in builder.blobs),
                       blob_sizes=tuple(b.compressed_size for b in builder.blobs),
                       stored_chunks=builder.stored, deduplicated_chunks=builder.deduplicated)


__all__ = ["NydusResult", "write_nydus"]
