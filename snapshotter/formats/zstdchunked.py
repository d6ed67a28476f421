"""zstd:chunked layers: footer, annotations and TOC ("manifest") reader, and a writer.

A zstd:chunked blob is an ordinary multi-frame zstd stream whose decompression is the layer tar
(media type application/vnd.oci.image.layer.v1.tar+zstd), with every regular file's payload
chunk starting a new zstd frame, followed by zstd *skippable* frames (magic 50 2A 4D 18, u32 LE
length) that carry the TOC and a footer. Two layouts exist (see /work/shared/FORMATS.md 2.1, 2.2):

`Layout.STARGZ` - stargz-snapshotter's `estargz/zstdchunked` (and containers/storage before 2023):
  [data frames][skippable: zstd(eStargz JTOC JSON)][skippable: 40-byte footer]. The footer is the
  last 48 blob bytes: u64 manifest offset (of the compressed TOC, after its 8-byte frame header),
  u64 compressed size, u64 uncompressed size, u64 type = 1, magic "GnUlInUx". Annotations
  `io.containers.zstd-chunked.manifest-checksum` (sha256 of the compressed TOC) and
  `io.containers.zstd-chunked.manifest-position` "off:clen:ulen:1". TOC digest (what
  `containerd.io/snapshot/stargz/toc.digest` holds) = sha256 of the *uncompressed* JSON.
  A chunk's compressed range runs to the next larger payload offset (or to the TOC frame).
`Layout.CONTAINERS` - containers/storage since 2023-08: [data frames][skippable: zstd(TOC)]
  [skippable: zstd(tar-split)][skippable: 64-byte footer] (last 72 bytes): the four manifest
  fields, then tar-split offset / compressed / uncompressed size, magic "GNUlInUx". Annotations
  `io.github.containers.zstd-chunked.manifest-checksum` / `-manifest-position` /
  `-tarsplit-position`. TOC digest = the manifest checksum = sha256 of the *compressed* TOC.
  Entries carry `endOffset` (a file's last chunk ends there) and `chunkType` ("" or "zeros").

Both TOCs are one JSON shape (eStargz JTOC plus the containers/storage keys), whose entries
`jtoc.py` reads by the same rules as eStargz's. Chunks are `Compression.ZSTD` ranges of the
layer blob; "zeros" chunks get `Chunk.zeros` (their range still decompresses to zeros, but need
not be fetched).

Writer: `write_zstdchunked` writes `Layout.STARGZ`, because that is the layout the rest of the
containerd ecosystem we interoperate with reads lazily (stargz-snapshotter, `ctr-remote`), it has
the eStargz prefetch landmarks, and it needs no tar-split (whose CRC-64 file records only podman
uses). Like ctr-remote, it publishes both the manifest-position/-checksum annotations and the
`containerd.io/snapshot/stargz/toc.digest` one. The data part is the source tar byte for byte
(headers, padding, end-of-archive) unless a landmark is requested, so with `prefetch=None` the
DiffID of the converted layer equals the source tar's sha256.

Verification (tests/formats/test_zstdchunked.py):
- Reader, `Layout.STARGZ`: real `ctr-remote image convert --zstdchunked --oci` output
  (stargz-snapshotter 0.12.0, Debian), read from a containerd 1.6 content store with its
  manifest annotations.
- Reader, `Layout.CONTAINERS` (and the 2020 40-byte variant): blobs built in the tests from the
  documented facts (FORMATS.md 2.1, containers/storage sources); no podman here, so never
  checked against real podman/containers-storage output.
- Writer: read back by our reader; decompressed whole by plain zstd; imported and unpacked by
  containerd 1.6 (ordinary +zstd media type, DiffID checked); read, TOC-digest-verified and
  chunk-verified by stargz-snapshotter 0.12's Go `estargz` package with its zstdchunked
  decompressor (a small Go program built in the test).

Contracts: pure (no IO beyond caller-provided streams); every malformed input raises FormatError
(LimitExceeded / DigestMismatch where those fit), and TOC decompression never produces more than
`max_toc_bytes`.
"""

from __future__ import annotations

import base64
import bisect
import datetime
import enum
import hashlib
import io
import json
import re
import struct
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, BinaryIO

import msgspec
import zstandard

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded
from snapshotter.formats.index import (
    LANDMARK_CONTENTS,
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    Chunk,
    Compression,
    LayerIndex,
    normalize_name,
)
from snapshotter.formats.jtoc import (
    ZSTD_CHUNKED,
    PendingEntry,
    build_entries,
    decode_toc,
    read_entries,
)
from snapshotter.formats.tail_hint import tail_size_annotation
from snapshotter.formats.toc_fields import (
    DIGEST_RE,
    MAX_INT,
)
from snapshotter.gcpause import gc_paused

FORMAT_NAME = "zstd:chunked"
SKIPPABLE_MAGIC = b"\x50\x2a\x4d\x18"
SKIPPABLE_HEADER = 8
STARGZ_MAGIC = b"GnUlInUx"
CONTAINERS_MAGIC = b"GNUlInUx"
STARGZ_FOOTER_SIZE = SKIPPABLE_HEADER + 40
CONTAINERS_FOOTER_SIZE = SKIPPABLE_HEADER + 64
FOOTER_SIZE = CONTAINERS_FOOTER_SIZE  # fetch this many tail bytes; parse_footer finds either layout
MANIFEST_TYPE_CRFS = 1

STARGZ_CHECKSUM_KEY = "io.containers.zstd-chunked.manifest-checksum"
STARGZ_POSITION_KEY = "io.containers.zstd-chunked.manifest-position"
CONTAINERS_CHECKSUM_KEY = "io.github.containers.zstd-chunked.manifest-checksum"
CONTAINERS_POSITION_KEY = "io.github.containers.zstd-chunked.manifest-position"
CONTAINERS_TARSPLIT_KEY = "io.github.containers.zstd-chunked.tarsplit-position"
TOC_DIGEST_KEY = "containerd.io/snapshot/stargz/toc.digest"
UNCOMPRESSED_SIZE_KEY = "io.containers.estargz.uncompressed-size"

_DECIMAL_RE = re.compile(r"[0-9]{1,19}")
_READ_BLOCK = 1 << 20


class Layout(enum.Enum):
    STARGZ = "stargz"  # 40-byte footer, magic GnUlInUx, io.containers.* annotations
    CONTAINERS = "containers"  # 64-byte footer, magic GNUlInUx, io.github.containers.* annotations


@dataclass(frozen=True, slots=True)
class ManifestPosition:
    """Where a zstd:chunked TOC lives, from the footer or from layer annotations.

    offset: blob offset of the compressed TOC bytes (just after its skippable frame header).
    checksum: "sha256:hex" of the compressed TOC, when an annotation gave one (footers carry none).
    tar_split: (offset, compressed size, uncompressed size) for Layout.CONTAINERS, when known.
    """

    offset: int
    compressed_size: int
    uncompressed_size: int
    manifest_type: int
    layout: Layout
    checksum: str | None = None
    tar_split: tuple[int, int, int] | None = None

    def check_fits(self, blob_size: int) -> None:
        """Raise FormatError unless the TOC lies inside a `blob_size`-byte blob before its footer."""
        footer = STARGZ_FOOTER_SIZE if self.layout is Layout.STARGZ else CONTAINERS_FOOTER_SIZE
        if self.offset < SKIPPABLE_HEADER or self.compressed_size <= 0 or \
                self.offset + self.compressed_size > blob_size - footer:
            raise FormatError(f"zstd:chunked manifest at {self.offset}+{self.compressed_size} does not fit "
                              f"a {blob_size}-byte blob")


ZstdFooter = ManifestPosition


def parse_footer(tail: bytes, *, blob_size: int | None = None) -> ZstdFooter:
    """Parse the footer from the last bytes of a blob (at least 48; FOOTER_SIZE covers both layouts).

    When `blob_size` is given, also checks that the manifest fits in the blob.
    """
    if len(tail) < STARGZ_FOOTER_SIZE:
        raise FormatError(f"zstd:chunked footer needs {STARGZ_FOOTER_SIZE} bytes, got {len(tail)}")
    pos: ManifestPosition | None = None
    if len(tail) >= CONTAINERS_FOOTER_SIZE and tail[-8:] == CONTAINERS_MAGIC:
        frame = tail[-CONTAINERS_FOOTER_SIZE:]
        if frame[:4] != SKIPPABLE_MAGIC or frame[4:8] != struct.pack("<I", 64):
            raise FormatError("zstd:chunked footer: magic GNUlInUx without a 64-byte skippable frame")
        off, clen, ulen, mtype, ts_off, ts_clen, ts_ulen = struct.unpack("<7Q", frame[8:64])
        pos = ManifestPosition(off, clen, ulen, mtype, Layout.CONTAINERS, tar_split=(ts_off, ts_clen, ts_ulen))
    elif tail[-8:] == STARGZ_MAGIC:
        frame = tail[-STARGZ_FOOTER_SIZE:]
        if frame[:4] != SKIPPABLE_MAGIC or frame[4:8] != struct.pack("<I", 40):
            raise FormatError("zstd:chunked footer: magic GnUlInUx without a 40-byte skippable frame")
        off, clen, ulen, mtype = struct.unpack("<4Q", frame[8:40])
        pos = ManifestPosition(off, clen, ulen, mtype, Layout.STARGZ)
    else:
        raise FormatError(f"not a zstd:chunked footer: trailing magic {tail[-8:]!r}")
    if pos.manifest_type != MANIFEST_TYPE_CRFS:
        raise FormatError(f"zstd:chunked footer: manifest type {pos.manifest_type}, expected 1")
    if pos.offset > MAX_INT or pos.compressed_size > MAX_INT or pos.uncompressed_size > MAX_INT:
        raise FormatError("zstd:chunked footer: field out of range")
    if blob_size is not None:
        pos.check_fits(blob_size)
    return pos


def _decimal(text: str, what: str) -> int:
    if not _DECIMAL_RE.fullmatch(text):
        raise FormatError(f"{what}: {text!r} is not a decimal number")
    return int(text)


def manifest_position_from_annotations(annotations: Mapping[str, str]) -> ManifestPosition | None:
    """The TOC position a layer descriptor's annotations give, or None if they give none.

    The io.github.containers.* keys (Layout.CONTAINERS) win over the io.containers.* ones.
    """
    if CONTAINERS_POSITION_KEY in annotations:
        layout, pkey, ckey = Layout.CONTAINERS, CONTAINERS_POSITION_KEY, CONTAINERS_CHECKSUM_KEY
    elif STARGZ_POSITION_KEY in annotations:
        layout, pkey, ckey = Layout.STARGZ, STARGZ_POSITION_KEY, STARGZ_CHECKSUM_KEY
    else:
        return None
    value = annotations[pkey]
    parts = value.split(":") if isinstance(value, str) else []
    if len(parts) != 4:
        raise FormatError(f"annotation {pkey}={value!r}: expected 'offset:length:uncompressed:type'")
    off, clen, ulen, mtype = (_decimal(p, f"annotation {pkey}") for p in parts)
    if mtype != MANIFEST_TYPE_CRFS:
        raise FormatError(f"annotation {pkey}={value!r}: manifest type {mtype}, expected 1")
    checksum = annotations.get(ckey)
    if checksum is not None and (not isinstance(checksum, str) or not DIGEST_RE.fullmatch(checksum)):
        raise FormatError(f"annotation {ckey}={checksum!r} is not 'sha256:<64 lowercase hex>'")
    tar_split = None
    ts = annotations.get(CONTAINERS_TARSPLIT_KEY) if layout is Layout.CONTAINERS else None
    if ts is not None:
        tparts = ts.split(":") if isinstance(ts, str) else []
        if len(tparts) != 3:
            raise FormatError(f"annotation {CONTAINERS_TARSPLIT_KEY}={ts!r}: expected 'offset:length:uncompressed'")
        a, b, c = (_decimal(p, f"annotation {CONTAINERS_TARSPLIT_KEY}") for p in tparts)
        tar_split = (a, b, c)
    return ManifestPosition(off, clen, ulen, mtype, layout, checksum=checksum, tar_split=tar_split)


# ---------------------------------------------------------------------------------------------
# Reader


def _bounded_unzstd(compressed: bytes, limit: int, what: str) -> bytes:
    """Decompress all frames of `compressed`; LimitExceeded as soon as output passes `limit`."""
    window = 1 << max(23, min(27, (max(limit, 1) - 1).bit_length()))
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=window)
        reader = dctx.stream_reader(io.BytesIO(compressed), read_across_frames=True)
        out = bytearray()
        while True:
            piece = reader.read(min(_READ_BLOCK, limit + 1 - len(out)))
            if not piece:
                break
            out += piece
            if len(out) > limit:
                raise LimitExceeded(f"{what}: decompresses to more than {limit} bytes")
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: zstd data is corrupt: {exc}") from None
    if not out:
        raise FormatError(f"{what}: decompresses to nothing")
    return bytes(out)












def _finish_chunks(p: PendingEntry, offsets: Sequence[int], data_end: int, what: str) -> tuple[Chunk, ...]:
    """A zstd chunk's compressed range runs to the next larger payload offset, the file's
    endOffset (its last chunk), or `data_end`."""
    if not p.chunks:
        raise FormatError(f"{what}: regular file {p.name!r} has {p.size} bytes but no payload offset")
    out: list[Chunk] = []
    for i, rc in enumerate(p.chunks):
        last = i + 1 == len(p.chunks)
        end = p.size if last else p.chunks[i + 1].file_offset
        size = end - rc.file_offset if rc.file_offset else end  # a one-chunk file: its own size int
        if size <= 0 or (rc.size and rc.size != size):
            raise FormatError(f"{what}: file {p.name!r}: chunk at file offset {rc.file_offset} (size "
                              f"{rc.size}) does not meet the next at {end}")
        if not 0 < rc.blob_offset < data_end:
            raise FormatError(f"{what}: file {p.name!r}: chunk offset {rc.blob_offset} is outside the "
                              f"data area [1, {data_end})")
        j = bisect.bisect_right(offsets, rc.blob_offset)
        blob_end = offsets[j] if j < len(offsets) else data_end
        if last and p.end_offset:
            # containers/storage: the last chunk's frame ends at endOffset; tar bytes may follow.
            if not rc.blob_offset < p.end_offset <= blob_end:
                raise FormatError(f"{what}: file {p.name!r}: endOffset {p.end_offset} is not after "
                                  f"{rc.blob_offset} and at most {blob_end}")
            blob_end = p.end_offset
        digest = rc.digest
        if digest is None and len(p.chunks) == 1:
            digest = p.digest  # one chunk: the file digest covers exactly its bytes
        out.append(Chunk(file_offset=rc.file_offset, size=size, blob_offset=rc.blob_offset,
                         blob_size=blob_end - rc.blob_offset, compression=Compression.ZSTD,
                         digest=digest, inner_offset=rc.inner_offset, zeros=rc.zeros))
    return tuple(out)


def parse_manifest(compressed: bytes, *, blob_size: int, layer_digest: str, max_toc_bytes: int,
                   expected_checksum: str | None = None,
                   position: ManifestPosition | None = None) -> LayerIndex:
    """Parse the compressed TOC (blob[position.offset : +compressed_size]) into a LayerIndex.

    expected_checksum: "sha256:hex" of the compressed TOC (the manifest-checksum annotation);
      a mismatch raises DigestMismatch.
    position: from `parse_footer` or `manifest_position_from_annotations`; gives the layout (hence
      the toc_digest rule), the exact data end, and sizes to check. Without it the layout is
      guessed from the JSON (endOffset / tarSplitDigest => CONTAINERS) and, for STARGZ, the TOC
      frame is assumed to sit right before the 48-byte footer.
    """
    what = f"zstd:chunked manifest of layer {layer_digest}"
    if len(compressed) > max_toc_bytes:
        raise LimitExceeded(f"{what}: {len(compressed)} compressed bytes, over the limit of {max_toc_bytes}")
    if position is not None:
        if position.compressed_size != len(compressed):
            raise FormatError(f"{what}: got {len(compressed)} bytes, position says {position.compressed_size}")
        if position.uncompressed_size > max_toc_bytes:
            raise LimitExceeded(f"{what}: {position.uncompressed_size} uncompressed bytes, over the limit "
                                f"of {max_toc_bytes}")
        position.check_fits(blob_size)
    checksum = "sha256:" + hashlib.sha256(compressed).hexdigest()
    if expected_checksum is not None and expected_checksum != checksum:
        raise DigestMismatch(f"{what}: checksum is {checksum}, expected {expected_checksum}")
    data = _bounded_unzstd(compressed, max_toc_bytes, what)
    if position is not None and len(data) != position.uncompressed_size:
        raise FormatError(f"{what}: decompresses to {len(data)} bytes, position says {position.uncompressed_size}")
    with gc_paused():  # about ten objects per entry and no cycles
        doc = decode_toc(data, what)
        raws = doc.entries
        if position is not None:
            layout = position.layout
            data_end = position.offset - SKIPPABLE_HEADER
        else:
            guessed = doc.has_tar_split or any(r is not None and r.endOffset is not msgspec.UNSET for r in raws)
            layout = Layout.CONTAINERS if guessed else Layout.STARGZ
            data_end = blob_size - STARGZ_FOOTER_SIZE - SKIPPABLE_HEADER - len(compressed) \
                if layout is Layout.STARGZ else blob_size
        if data_end < 0 or data_end > blob_size:
            raise FormatError(f"{what}: data area [0, {data_end}) does not fit a {blob_size}-byte blob")
        toc = read_entries(raws, what, ZSTD_CHUNKED, checked=doc.checked)
        entries, landmark, prefetch = build_entries(
            toc, lambda p, offs: _finish_chunks(p, offs, data_end, what), what)
        toc_digest = checksum if layout is Layout.CONTAINERS else "sha256:" + hashlib.sha256(data).hexdigest()
        return LayerIndex(format=FORMAT_NAME, entries=entries, blobs=(layer_digest,), landmark=landmark,
                          prefetch=prefetch, toc_digest=toc_digest)


# ---------------------------------------------------------------------------------------------
# Writer


@dataclass(frozen=True)
class ZstdChunkedResult:
    """What `write_zstdchunked` produced.

    blob_digest/blob_size: of the bytes written to dst. diff_id: sha256 of the tar the blob
    decompresses to (uncompressed_size bytes). toc_digest: sha256 of the uncompressed TOC JSON
    (stargz-snapshotter's rule); manifest_checksum: sha256 of the compressed TOC.
    annotations: for the layer descriptor (the same keys ctr-remote writes, plus our tail-size
    hint, `tail_hint.py`).
    """

    blob_digest: str
    blob_size: int
    diff_id: str
    uncompressed_size: int
    toc_digest: str
    manifest_checksum: str
    position: ManifestPosition
    annotations: Mapping[str, str]


class _Frames:
    """Writes the uncompressed tar as zstd frames to dst, counting and hashing both sides."""

    def __init__(self, dst: BinaryIO, level: int) -> None:
        self._dst = dst
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self._cobj: Any = None
        self.offset = 0
        self.blob_hash = hashlib.sha256()
        self.diff_hash = hashlib.sha256()
        self.uncompressed = 0

    def raw(self, data: bytes) -> None:
        if data:
            self._dst.write(data)
            self.blob_hash.update(data)
            self.offset += len(data)

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._cobj is None:
            self._cobj = self._cctx.compressobj()
        self.diff_hash.update(data)
        self.uncompressed += len(data)
        self.raw(self._cobj.compress(data))

    def close_frame(self) -> None:
        if self._cobj is not None:
            self.raw(self._cobj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
            self._cobj = None

    def skippable(self, payload: bytes) -> int:
        """Write a skippable frame; returns the offset of its payload."""
        self.close_frame()
        self.raw(SKIPPABLE_MAGIC + struct.pack("<I", len(payload)))
        start = self.offset
        self.raw(payload)
        return start


@dataclass
class _Member:
    """One tar member: its raw header blocks (extended headers included) and its metadata."""

    header: bytes
    info: tarfile.TarInfo
    payload: int  # bytes of payload + padding that follow the header in the source
    data_pos: int = -1  # source offset of the payload (seekable sources only)


_HEADER_ONLY = {tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.DIRTYPE,
                tarfile.FIFOTYPE}
_EXTENSIONS = {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
               tarfile.GNUTYPE_LONGLINK}
_MAX_EXTENSION = 16 << 20


class _TarSource:
    def __init__(self, src: BinaryIO) -> None:
        self.src = src
        self.pos = 0
        self.pushback = b""  # the end-of-archive block `_members` read, for the caller to copy

    def read(self, n: int) -> bytes:
        out = bytearray(self.pushback[:n])
        self.pushback = self.pushback[n:]
        while len(out) < n:
            piece = self.src.read(min(n - len(out), _READ_BLOCK))
            if not piece:
                break
            out += piece
            self.pos += len(piece)
        return bytes(out)

    def exact(self, n: int, what: str) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise FormatError(f"source tar is truncated in {what}")
        return data


def _parse_header(globals_: bytes, raw: bytes) -> tarfile.TarInfo:
    try:
        tf = tarfile.TarFile(fileobj=io.BytesIO(globals_ + raw), mode="r", encoding="utf-8",
                             errors="surrogateescape")
    except (tarfile.TarError, UnicodeError, ValueError, EOFError) as exc:
        raise FormatError(f"source tar has a bad header: {exc}") from None
    info = tf.next()  # the first member: already parsed by the constructor, data not read
    if info is None:
        raise FormatError("source tar has a bad header")
    return info


def _members(ts: _TarSource, *, seekable: bool) -> Iterator[_Member]:
    """Tar members of the source, in order; the caller consumes each payload (unless seekable)
    before asking for the next. Stops at the end-of-archive block (left unread) or at EOF."""
    pending = bytearray()
    globals_ = bytearray()
    while True:
        start = ts.pos
        block = ts.read(512)
        if not block and not pending:
            return
        if len(block) != 512:
            raise FormatError(f"source tar is truncated at offset {start}")
        if block == bytes(512):
            if pending:
                raise FormatError("source tar ends inside an extended header")
            ts.pushback = block
            return
        try:
            head = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except (tarfile.TarError, UnicodeError, ValueError) as exc:
            raise FormatError(f"source tar has a bad header at offset {start}: {exc}") from None
        if head.type in _EXTENSIONS:
            if head.size > _MAX_EXTENSION:
                raise FormatError(f"source tar: extended header at {start} is {head.size} bytes")
            ext = block + ts.exact(-(-head.size // 512) * 512, "an extended header")
            pending += ext
            if head.type == tarfile.XGLTYPE:
                globals_ += ext
            continue
        header = bytes(pending) + block
        pending.clear()
        info = _parse_header(bytes(globals_), header)
        if info.issparse() or any(k.startswith("GNU.sparse.") for k in info.pax_headers):
            raise FormatError(f"source tar: sparse file {info.name!r} is not supported")
        if info.isreg():
            payload = -(-info.size // 512) * 512
        elif info.type in _HEADER_ONLY:
            payload = 0
        else:
            raise FormatError(f"source tar: unsupported entry type {info.type!r} for {info.name!r}")
        yield _Member(header, info, payload, ts.pos if seekable else -1)
        if seekable:
            ts.src.seek(payload, io.SEEK_CUR)
            ts.pos += payload


def _modtime(mtime: float) -> str:
    secs = int(mtime // 1)
    if secs == 0:
        return ""
    t = datetime.datetime(1970, 1, 1) + datetime.timedelta(seconds=secs)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class _TocBuilder:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._unames: dict[int, str] = {}
        self._gnames: dict[int, str] = {}

    def _if_changed(self, names: dict[int, str], id_: int, name: str) -> str:
        if not name or names.get(id_) == name:
            return ""
        names[id_] = name
        return name

    def base(self, info: tarfile.TarInfo) -> dict[str, Any]:
        kinds = {tarfile.LNKTYPE: "hardlink", tarfile.SYMTYPE: "symlink", tarfile.DIRTYPE: "dir",
                 tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo"}
        kind = "reg" if info.isreg() else kinds[info.type]
        name = info.name + "/" if kind == "dir" and not info.name.endswith("/") else info.name
        e: dict[str, Any] = {"name": name, "type": kind}
        if kind == "reg" and info.size:
            e["size"] = info.size
        opt: dict[str, Any] = {
            "modtime": _modtime(info.mtime),
            "linkName": info.linkname if kind in ("hardlink", "symlink") else "",
            "mode": info.mode, "uid": info.uid, "gid": info.gid,
            "userName": self._if_changed(self._unames, info.uid, info.uname),
            "groupName": self._if_changed(self._gnames, info.gid, info.gname),
        }
        if kind in ("char", "block"):
            opt["devMajor"], opt["devMinor"] = info.devmajor, info.devminor
        xattrs = {k[len("SCHILY.xattr."):]: base64.b64encode(v.encode("utf-8", "surrogateescape")).decode()
                  for k, v in sorted(info.pax_headers.items()) if k.startswith("SCHILY.xattr.")}
        opt["xattrs"] = xattrs
        e.update((k, v) for k, v in opt.items() if v)
        return e


def _copy_member(m: _Member, ts: _TarSource, frames: _Frames, toc: _TocBuilder, chunk_size: int) -> None:
    frames.write(m.header)
    entry = toc.base(m.info)
    if m.data_pos >= 0:
        ts.src.seek(m.data_pos)
    if not m.info.isreg():
        toc.entries.append(entry)
        return
    file_hash = hashlib.sha256()
    written = 0
    while written < m.info.size:
        frames.close_frame()
        this = min(chunk_size, m.info.size - written)
        if this == chunk_size:
            entry["chunkSize"] = this
        entry["offset"] = frames.offset
        if written:
            entry["chunkOffset"] = written
        chunk_hash = hashlib.sha256()
        left = this
        while left:
            data = ts.exact(min(left, _READ_BLOCK), f"the payload of {m.info.name!r}")
            chunk_hash.update(data)
            file_hash.update(data)
            frames.write(data)
            left -= len(data)
        entry["chunkDigest"] = "sha256:" + chunk_hash.hexdigest()
        toc.entries.append(entry)
        written += this
        entry = {"name": m.info.name, "type": "chunk"}
    if not m.info.size:
        toc.entries.append(entry)
    first = next(e for e in reversed(toc.entries) if e["type"] == "reg")
    # Keep the key order of Go's TOCEntry: digest comes before the chunk fields.
    chunk_fields = {k: first.pop(k) for k in ("chunkOffset", "chunkSize", "chunkDigest") if k in first}
    first["digest"] = "sha256:" + file_hash.hexdigest()
    first.update(chunk_fields)
    frames.write(ts.exact(m.payload - m.info.size, f"the padding of {m.info.name!r}"))


def _landmark(name: str) -> _Member:
    info = tarfile.TarInfo(name)
    info.size = len(LANDMARK_CONTENTS)
    info.mode = 0o644
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    return _Member(header, info, 512)


def _prefetch_order(members: list[_Member], prefetch: Sequence[str]) -> list[_Member]:
    """eStargz's order: each prefetch file with its parent dirs and hard-link targets first."""
    index: dict[str, _Member] = {}
    for m in members:
        index[normalize_name(m.info.name)] = m  # a later duplicate replaces an earlier one
    remaining = {id(m) for m in index.values()}
    front: list[_Member] = []

    def move(name: str, depth: int = 0) -> bool:
        if depth > 4096:
            raise FormatError(f"hard links around {name!r} nest too deep")
        m = index.get(name)
        if name:
            move(name.rpartition("/")[0], depth + 1)
        if m is None or id(m) not in remaining:
            return m is not None or not name
        if m.info.type == tarfile.LNKTYPE:
            move(normalize_name(m.info.linkname), depth + 1)
        if id(m) in remaining:
            remaining.discard(id(m))
            front.append(m)
        return True

    for raw in prefetch:
        if not move(normalize_name(raw)):
            raise ValueError(f"prefetch file {raw!r} is not in the layer")
    rest = [m for m in members if id(m) in remaining and index[normalize_name(m.info.name)] is m]
    return front + [_landmark(PREFETCH_LANDMARK)] + rest


def write_zstdchunked(src: BinaryIO, dst: BinaryIO, *, chunk_size: int = 4 << 20,
                      prefetch: Sequence[str] | None = None, level: int = 3) -> ZstdChunkedResult:
    """Convert the layer tar `src` into a Layout.STARGZ zstd:chunked blob written to `dst`.

    prefetch=None: the tar is kept byte for byte, no landmark (DiffID = sha256 of src).
    prefetch=[]: a `.no.prefetch.landmark` is put first, the rest kept as is.
    prefetch=[names...]: like eStargz, those files (with their parent directories and hard-link
      targets) come first, then `.prefetch.landmark`, then the rest; needs a seekable src. A
      name not in the layer raises ValueError. Existing landmarks are dropped in both cases.
    Memory stays bounded (about one read block plus the zstd window), whatever the file sizes.
    Raises FormatError for a malformed source tar (or sparse / unsupported entry types).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    frames = _Frames(dst, level)
    toc = _TocBuilder()
    ts = _TarSource(src)
    landmarks = {PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK}
    if prefetch:
        ts.pos = src.tell()
        members = [m for m in _members(ts, seekable=True) if normalize_name(m.info.name) not in landmarks]
        ts.pushback = b""  # members are read by seeking; the end-of-archive block is rewritten
        for m in _prefetch_order(members, prefetch):
            if m.data_pos < 0:  # the landmark we made
                frames.write(m.header)
                _landmark_toc(m, frames, toc)
                continue
            _copy_member(m, ts, frames, toc, chunk_size)
        frames.write(bytes(1024))
    else:
        if prefetch is not None:
            lm = _landmark(NO_PREFETCH_LANDMARK)
            frames.write(lm.header)
            _landmark_toc(lm, frames, toc)
        for m in _members(ts, seekable=False):
            if prefetch is not None and normalize_name(m.info.name) in landmarks:
                ts.exact(m.payload, "a landmark")
                continue
            _copy_member(m, ts, frames, toc, chunk_size)
        while trailer := ts.read(_READ_BLOCK):  # end-of-archive blocks and record padding, verbatim
            frames.write(trailer)
    frames.close_frame()

    data_end = frames.offset
    toc_json = json.dumps({"version": 1, "entries": toc.entries}, indent="\t").encode()
    compressed = zstandard.ZstdCompressor(level=level).compress(toc_json)
    toc_offset = frames.skippable(compressed)
    assert toc_offset == data_end + SKIPPABLE_HEADER
    frames.skippable(struct.pack("<4Q", toc_offset, len(compressed), len(toc_json), MANIFEST_TYPE_CRFS)
                     + STARGZ_MAGIC)
    checksum = "sha256:" + hashlib.sha256(compressed).hexdigest()
    toc_digest = "sha256:" + hashlib.sha256(toc_json).hexdigest()
    position = ManifestPosition(toc_offset, len(compressed), len(toc_json), MANIFEST_TYPE_CRFS,
                                Layout.STARGZ, checksum=checksum)
    annotations = {
        TOC_DIGEST_KEY: toc_digest,
        UNCOMPRESSED_SIZE_KEY: str(frames.uncompressed),
        STARGZ_CHECKSUM_KEY: checksum,
        STARGZ_POSITION_KEY: f"{toc_offset}:{len(compressed)}:{len(toc_json)}:{MANIFEST_TYPE_CRFS}",
        **tail_size_annotation(frames.offset, toc_offset),
    }
    return ZstdChunkedResult(
        blob_digest="sha256:" + frames.blob_hash.hexdigest(), blob_size=frames.offset,
        diff_id="sha256:" + frames.diff_hash.hexdigest(), uncompressed_size=frames.uncompressed,
        toc_digest=toc_digest, manifest_checksum=checksum, position=position,
        annotations=MappingProxyType(annotations),
    )


def _landmark_toc(m: _Member, frames: _Frames, toc: _TocBuilder) -> None:
    """A landmark's payload in its own frame, as eStargz writes every non-empty file."""
    frames.close_frame()
    entry = toc.base(m.info)
    entry["offset"] = frames.offset
    digest = "sha256:" + hashlib.sha256(LANDMARK_CONTENTS).hexdigest()
    entry["digest"] = entry["chunkDigest"] = digest
    frames.write(LANDMARK_CONTENTS + bytes(511))
    toc.entries.append(entry)
