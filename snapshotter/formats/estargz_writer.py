"""Convert an uncompressed layer tar into an eStargz (or legacy stargz) blob, streaming.

Layout written (the same shape as stargz-snapshotter's `estargz.Build`):
- tar headers (PAX where needed: long names, xattrs, big ids) go into the current gzip member;
- every regular file's payload starts a new gzip member at each chunk boundary (`chunk_size`);
  the tar padding and the following headers stay in the last chunk's member;
- no tar end marker in the payload: the TOC member holds a tar with "stargz.index.json" and the
  end marker, so gunzipping the whole blob yields one valid tar (what containerd unpacks and
  hashes for the DiffID);
- the 51-byte footer (47 bytes with `legacy=True`).

Entry order and landmarks: `prefetch=None` keeps tar order and writes no landmark (like the Go
`Writer.AppendTar`); `prefetch=[]` writes `.no.prefetch.landmark` first (what `ctr-remote image
convert --estargz` does without a record file); a non-empty list moves those files, with their
parent directories and hard-link targets, to the front in that order, then `.prefetch.landmark`,
then the rest (names not in the layer, or whose parent directories are not, are skipped and
reported in `missing_prefetch`, as ctr-remote does).
Existing landmarks and "stargz.index.json" entries of the input are dropped; with a seekable `src`
a name that appears twice keeps only its last entry (as the Go builder does); with a
non-seekable `src` (one pass) a duplicate name raises FormatError.

Memory: file data is copied in 1 MiB blocks whatever its size or `chunk_size`; what grows with the
layer is the TOC (and, for a seekable source, one TarInfo per entry).
"""

from __future__ import annotations

import base64
import copy
import datetime
import hashlib
import io
import json
import math
import posixpath
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

from snapshotter.errors import FormatError
from snapshotter.formats.estargz_footer import footer_bytes
from snapshotter.formats.estargz_toc import TOC_TAR_NAME
from snapshotter.formats.index import (
    LANDMARK_CONTENTS,
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    normalize_name,
)
from snapshotter.formats.tail_hint import tail_size_annotation

TOC_DIGEST_ANNOTATION = "containerd.io/snapshot/stargz/toc.digest"
UNCOMPRESSED_SIZE_ANNOTATION = "io.containers.estargz.uncompressed-size"

_COPY = 1 << 20
_TOC_KEYS = ("name", "type", "size", "modtime", "linkName", "mode", "uid", "gid", "userName", "groupName",
             "offset", "devMajor", "devMinor", "xattrs", "digest", "chunkOffset", "chunkSize", "chunkDigest")
_TYPE_NAMES = {
    tarfile.DIRTYPE: "dir", tarfile.REGTYPE: "reg", tarfile.AREGTYPE: "reg", tarfile.CONTTYPE: "reg",
    tarfile.GNUTYPE_SPARSE: "reg", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo",
}
_XATTR_PREFIX = "SCHILY.xattr."


@dataclass(frozen=True)
class EstargzResult:
    """What a conversion produced. `diff_id` = sha256 of the whole gunzipped blob."""

    digest: str
    size: int
    diff_id: str
    toc_digest: str
    uncompressed_size: int
    missing_prefetch: tuple[str, ...] = ()
    toc_offset: int = 0  # where the TOC's gzip member starts

    def annotations(self) -> dict[str, str]:
        """The layer descriptor annotations ctr-remote sets for an eStargz layer, plus our
        tail-size hint (`tail_hint.py`)."""
        return {
            TOC_DIGEST_ANNOTATION: self.toc_digest,
            UNCOMPRESSED_SIZE_ANNOTATION: str(self.uncompressed_size),
            **tail_size_annotation(self.size, self.toc_offset),
        }


class _BlobWriter:
    """Writes gzip members to dst, tracking offsets, the blob digest and the DiffID."""

    def __init__(self, dst: IO[bytes], level: int) -> None:
        self._dst = dst
        self._level = level
        self._z: Any = None
        self.offset = 0
        self.uncompressed = 0
        self.blob_hash = hashlib.sha256()
        self.diff_hash = hashlib.sha256()

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.diff_hash.update(data)
        self.uncompressed += len(data)
        if self._z is None:
            self._z = zlib.compressobj(self._level, zlib.DEFLATED, 31)
        self._emit(self._z.compress(data))

    def close_member(self) -> None:
        if self._z is not None:
            self._emit(self._z.flush())
            self._z = None

    def _emit(self, data: bytes) -> None:
        if data:
            self._dst.write(data)
            self.blob_hash.update(data)
            self.offset += len(data)

    def raw(self, data: bytes) -> None:
        """Append bytes that are already a complete gzip member (the footer)."""
        self.close_member()
        self._emit(data)


def _clean(name: str) -> str:
    """The Go builder's name cleaning for prefetch lists: "/a", "./a", "../a" all mean "a"."""
    return posixpath.normpath("/" + name.lstrip("/")).lstrip("/")


def _landmark(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.REGTYPE
    info.size = len(LANDMARK_CONTENTS)
    info.mode = 0
    info.mtime = 0
    return info


_Item = tuple[tarfile.TarInfo, "IO[bytes] | None"]


def _skip(name: str) -> bool:
    return name in (PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK, TOC_TAR_NAME)


def _check_member(m: tarfile.TarInfo) -> str:
    if m.type not in _TYPE_NAMES:
        raise FormatError(f"layer tar entry {m.name!r} has unsupported type {m.type!r}")
    return normalize_name(m.name)


def _stream_items(tf: tarfile.TarFile) -> Iterator[_Item]:
    seen: set[str] = set()
    for m in tf:
        name = _check_member(m)
        if _skip(name):
            continue
        if name in seen:
            raise FormatError(f"layer tar lists {m.name!r} twice; pass a seekable stream to keep the last")
        seen.add(name)
        yield m, tf.extractfile(m) if m.isreg() else None


def _ordered_members(tf: tarfile.TarFile, prefetch: Sequence[str] | None
                     ) -> tuple[list[tarfile.TarInfo], list[tarfile.TarInfo], list[str]]:
    """(front, rest, missing): prefetch files with their parents and link targets, then the rest."""
    rest: dict[str, tarfile.TarInfo] = {}
    for m in tf:
        name = _check_member(m)
        if _skip(name):
            continue
        rest.pop(name, None)  # a later entry replaces an earlier one, at the later position
        rest[name] = m
    front: dict[str, tarfile.TarInfo] = {}
    missing: list[str] = []

    def move(name: str) -> bool:
        # The Go builder's moveRec: a name counts as found only if it and all its parent
        # directories (and a hard link's target) are in the tar; then parents go first.
        if name == "":
            if "" in rest:
                front[""] = rest.pop("")
            return True
        if name not in rest and name not in front:
            return False
        if not move(posixpath.dirname(name)):
            return False
        m = rest.get(name)
        if m is not None and m.islnk() and not move(_clean(m.linkname)):
            return False
        if name in rest:
            front[name] = rest.pop(name)
        return True

    for wanted in prefetch or ():
        try:
            found = move(_clean(wanted))
        except RecursionError:
            raise FormatError(f"layer tar: prefetch name {wanted[:200]!r} is nested too deeply") from None
        if not found:
            missing.append(wanted)
    return list(front.values()), list(rest.values()), missing


def _tar_header(m: tarfile.TarInfo) -> bytes:
    info = copy.copy(m)
    info.pax_headers = {k: v for k, v in m.pax_headers.items() if not k.startswith("GNU.sparse.")}
    if m.isreg():
        info.type = tarfile.REGTYPE
        info.sparse = None  # type: ignore[attr-defined]
    else:
        info.size = 0
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _modtime(mtime: float) -> str:
    secs = math.floor(mtime + 0.5)  # Go rounds to the nearest second
    if secs == 0:
        return ""
    try:
        t = datetime.datetime.fromtimestamp(secs, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        raise FormatError(f"layer tar: modification time {mtime} is out of range") from None
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class _Toc:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._unames: dict[int, str] = {}
        self._gnames: dict[int, str] = {}

    def entry(self, m: tarfile.TarInfo) -> dict[str, Any]:
        ent: dict[str, Any] = {"name": m.name + ("/" if m.isdir() else ""), "type": _TYPE_NAMES[m.type]}
        if ent["type"] == "reg":
            ent["size"] = m.size
        ent["modtime"] = _modtime(m.mtime)
        if m.issym() or m.islnk():
            ent["linkName"] = m.linkname
        ent["mode"] = m.mode
        ent["uid"], ent["gid"] = m.uid, m.gid
        if m.uname and self._unames.get(m.uid) != m.uname:
            self._unames[m.uid] = ent["userName"] = m.uname
        if m.gname and self._gnames.get(m.gid) != m.gname:
            self._gnames[m.gid] = ent["groupName"] = m.gname
        if m.ischr() or m.isblk():
            ent["devMajor"], ent["devMinor"] = m.devmajor, m.devminor
        xattrs = {k[len(_XATTR_PREFIX):]: base64.b64encode(v.encode("utf-8", "surrogateescape")).decode()
                  for k, v in m.pax_headers.items() if k.startswith(_XATTR_PREFIX)}
        if xattrs:
            ent["xattrs"] = xattrs
        return ent

    def json(self) -> bytes:
        # Go's omitempty: zero values are left out, except name and type.
        ordered = [{k: e[k] for k in _TOC_KEYS if k in e and (k in ("name", "type") or e[k])}
                   for e in self.entries]
        doc = {"version": 1, "entries": ordered}
        return json.dumps(doc, indent="\t", ensure_ascii=False).encode("utf-8")


def _copy_exact(src: IO[bytes], out: _BlobWriter, n: int, hashes: Sequence[Any], name: str) -> None:
    left = n
    while left:
        block = src.read(min(_COPY, left))
        if not block:
            raise FormatError(f"layer tar: {name!r} is truncated ({n - left} of {n} bytes)")
        for h in hashes:
            h.update(block)
        out.write(block)
        left -= len(block)


def _write_entry(out: _BlobWriter, toc: _Toc, m: tarfile.TarInfo, data: IO[bytes] | None,
                 chunk_size: int) -> None:
    ent = toc.entry(m)
    out.write(_tar_header(m))
    if not m.isreg():
        toc.entries.append(ent)
        return
    file_hash = hashlib.sha256()
    written = 0
    while written < m.size:
        assert data is not None
        out.close_member()
        n = min(chunk_size, m.size - written)
        if m.size - written >= chunk_size:
            ent["chunkSize"] = chunk_size
        ent["offset"] = out.offset
        ent["chunkOffset"] = written
        chunk_hash = hashlib.sha256()
        _copy_exact(data, out, n, (file_hash, chunk_hash), m.name)
        ent["chunkDigest"] = "sha256:" + chunk_hash.hexdigest()
        toc.entries.append(ent)
        written += n
        ent = {"name": m.name, "type": "chunk"}
    if m.size == 0:
        toc.entries.append(ent)
        first = ent
    else:
        first = next(e for e in reversed(toc.entries) if e["type"] == "reg")
    first["digest"] = "sha256:" + file_hash.hexdigest()
    out.write(b"\x00" * (-m.size % tarfile.BLOCKSIZE))


def write_estargz(src: BinaryIO, dst: BinaryIO, *, chunk_size: int = 4 << 20,
                  prefetch: Sequence[str] | None = None, legacy: bool = False,
                  level: int = 6) -> EstargzResult:
    """Read the uncompressed layer tar `src`, write the eStargz blob to `dst`.

    Raises FormatError for an unreadable tar, unsupported entry types, names with "..", NUL or a
    leading "/", and truncated members; ValueError for bad arguments (including a non-empty
    `prefetch` with a non-seekable `src`).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    if not -1 <= level <= 9:
        raise ValueError(f"gzip level must be in [-1, 9], not {level}")
    if isinstance(prefetch, str):
        raise ValueError("prefetch is a list of names, not a string")
    seekable = bool(getattr(src, "seekable", lambda: False)())
    if prefetch and not seekable:
        raise ValueError("reordering entries for prefetch needs a seekable source")
    out = _BlobWriter(dst, level)
    toc = _Toc()
    missing: list[str] = []
    try:
        tf = tarfile.open(fileobj=src, mode="r:" if seekable else "r|", errors="surrogateescape")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise FormatError(f"layer tar is unreadable: {exc}") from None
    try:
        with tf:
            if seekable:
                front, rest, missing = _ordered_members(tf, prefetch)
                items: Iterator[_Item] = (
                    (m, tf.extractfile(m) if m.isreg() else None) for m in front
                )
                tail: Iterator[_Item] = (
                    (m, tf.extractfile(m) if m.isreg() else None) for m in rest
                )
            else:
                items, tail = iter(()), _stream_items(tf)
            for m, data in items:
                _write_entry(out, toc, m, data, chunk_size)
            if prefetch is not None:
                mark = PREFETCH_LANDMARK if prefetch else NO_PREFETCH_LANDMARK
                _write_entry(out, toc, _landmark(mark), io.BytesIO(LANDMARK_CONTENTS), chunk_size)
            for m, data in tail:
                _write_entry(out, toc, m, data, chunk_size)
    except (tarfile.TarError, EOFError) as exc:
        raise FormatError(f"layer tar is unreadable: {exc}") from None
    out.close_member()
    toc_offset = out.offset
    toc_json = toc.json()
    info = tarfile.TarInfo(TOC_TAR_NAME)
    info.size = len(toc_json)
    info.mode = 0
    info.mtime = 0
    out.write(info.tobuf(tarfile.USTAR_FORMAT))
    out.write(toc_json + b"\x00" * (-len(toc_json) % tarfile.BLOCKSIZE))
    out.write(b"\x00" * (2 * tarfile.BLOCKSIZE))
    out.close_member()
    out.raw(footer_bytes(toc_offset, legacy=legacy))
    return EstargzResult(
        digest="sha256:" + out.blob_hash.hexdigest(), size=out.offset,
        diff_id="sha256:" + out.diff_hash.hexdigest(),
        toc_digest="sha256:" + hashlib.sha256(toc_json).hexdigest(),
        uncompressed_size=out.uncompressed, missing_prefetch=tuple(missing), toc_offset=toc_offset,
    )
