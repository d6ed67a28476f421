"""Read an eStargz / legacy stargz TOC member into a `LayerIndex`.

The TOC member is one gzip member holding a tar with a single USTAR entry "stargz.index.json"
whose content is the TOC JSON ({"version": 1, "entries": [...]}). Entries are listed in layer
order; a regular file's first chunk is described by its "reg" entry and each further chunk by a
following "chunk" entry. A chunk's compressed range runs from its `offset` to the next larger
payload offset in the TOC (or to the TOC member itself for the last one); `innerOffset` lets
several chunks share one gzip member.

Contracts:
- Memory is bounded by `max_toc_bytes`: a TOC whose tar header claims more raises LimitExceeded
  before anything that large is inflated; decompression never produces more than needed.
- Everything malformed raises FormatError (or its subclasses) naming the layer digest and the
  entry; nothing else escapes for any input bytes.
- Entries keep TOC order, including the landmark files; whiteouts/opaque markers stay entries.
  Parent directories missing from the TOC are not invented (the tar would not list them either).
- Stricter than the Go reader on purpose: duplicate names, names with "..", absolute names, an
  entry under a listed non-directory (file or symlink), hard links to missing entries or to
  directories, and chunks outside the payload area are FormatErrors.
- nlink: every name of a hard-link group gets the group's size; directories get 2 + the number
  of subdirectories listed in the TOC (the Go reader counts the root one lower).
- Memory: Python objects for the JSON are a small multiple of `max_toc_bytes`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded
from snapshotter.formats.estargz_footer import FOOTER_SIZE, MIN_GZIP_MEMBER
from snapshotter.formats.index import (
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    Chunk,
    Compression,
    Entry,
    EntryType,
    Landmark,
    LayerIndex,
    check_chunks,
    normalize_name,
)
from snapshotter.formats.toc_fields import (
    MAX_INT,
    digest_field,
    int_field,
    mtime_ns_field,
    str_field,
    xattrs_field,
)
from snapshotter.gcpause import gc_paused

TOC_TAR_NAME = "stargz.index.json"
FORMAT_NAME = "estargz"

# Deflate cannot expand data by more than 1032:1; a chunk claiming more bytes than that from its
# compressed range is lying, and would only make us inflate garbage.
_MAX_DEFLATE_RATIO = 1032
_MAX_ID = (1 << 32) - 1
_TYPES = {t.value: t for t in EntryType}
# After the JSON the TOC tar holds at most 511 padding bytes and the 1024-byte end marker; allow a
# little more (some writers pad to a record) before calling the member malformed.
_MAX_TOC_TRAILER = 1 << 16


class _Inflater:
    """Pulls exact amounts of output from one gzip member, never more than asked for."""

    def __init__(self, data: bytes, what: str) -> None:
        self._d = zlib.decompressobj(wbits=31)
        self._pending = data
        self._what = what

    def read(self, n: int) -> bytes:
        out = bytearray()
        try:
            while len(out) < n and not self._d.eof:
                piece = self._d.decompress(self._pending, n - len(out))
                self._pending = self._d.unconsumed_tail
                out += piece
                if not piece and not self._pending:
                    break
        except zlib.error as exc:
            raise FormatError(f"{self._what}: gzip data is corrupt: {exc}") from None
        return bytes(out)

    @property
    def eof(self) -> bool:
        return self._d.eof


def _tar_number(field_: bytes, what: str) -> int:
    if field_[:1] in (b"\x80", b"\xff"):
        raise FormatError(f"{what}: base-256 numbers are not used by stargz TOC headers")
    text = field_.split(b"\x00", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise FormatError(f"{what}: bad octal field {field_!r}") from None


def _toc_json(member: bytes, layer: str, max_toc_bytes: int) -> bytes:
    what = f"stargz TOC of layer {layer}"
    if len(member) < MIN_GZIP_MEMBER:
        raise FormatError(f"{what}: {len(member)} bytes is too short for a gzip member")
    inf = _Inflater(member, what)
    header = inf.read(512)
    if len(header) < 512:
        raise FormatError(f"{what}: truncated before the end of the tar header")
    name = header[:100].split(b"\x00", 1)[0]
    if name != TOC_TAR_NAME.encode() or header[345:346] not in (b"", b"\x00"):
        raise FormatError(f"{what}: tar entry is {name!r}, expected {TOC_TAR_NAME!r}")
    if header[156:157] not in (b"0", b"\x00"):
        raise FormatError(f"{what}: tar entry type {header[156:157]!r} is not a regular file")
    checksum = _tar_number(header[148:156], what)
    if checksum != sum(header[:148]) + 8 * 0x20 + sum(header[156:]):
        raise FormatError(f"{what}: tar header checksum mismatch")
    size = _tar_number(header[124:136], what)
    if size > max_toc_bytes:
        raise LimitExceeded(f"{what}: TOC JSON claims {size} bytes, over the limit of {max_toc_bytes}")
    data = inf.read(size)
    if len(data) < size:
        raise FormatError(f"{what}: truncated: {len(data)} of {size} TOC JSON bytes")
    # Read the rest of the member so zlib checks its CRC; the tail is padding and the end marker.
    tail = inf.read(_MAX_TOC_TRAILER)
    if not inf.eof:
        raise FormatError(f"{what}: gzip member does not end after the TOC tar (truncated or padded)")
    if tail.strip(b"\x00"):
        raise FormatError(f"{what}: unexpected data after the TOC JSON entry")
    return data












def _name(raw: str) -> str:
    """normalize_name, skipping the work for names that are already normal (most of them)."""
    if raw and raw[0] not in "./" and raw[-1] not in "./" and "/." not in raw and "//" not in raw \
            and "\x00" not in raw:
        return raw
    return normalize_name(raw)


@dataclass(slots=True)
class _RawChunk:
    file_offset: int
    size: int  # 0: to the end of the file
    blob_offset: int
    inner_offset: int
    digest: str | None


@dataclass(slots=True)
class _Pending:
    """An entry being built: Entry's fields but nlink and chunks, as attributes (a big TOC holds
    100k of these at once, and reads their name and type several times each); regular files
    collect their raw chunks here."""

    name: str
    type: EntryType
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    link_target: str
    dev_major: int
    dev_minor: int
    xattrs: Mapping[str, bytes]
    digest: str | None
    chunks: list[_RawChunk] = field(default_factory=list)

    def entry(self, nlink: int, chunks: tuple[Chunk, ...] = ()) -> Entry:
        return Entry(name=self.name, type=self.type, mode=self.mode, uid=self.uid, gid=self.gid,
                     mtime_ns=self.mtime_ns, size=self.size, link_target=self.link_target,
                     dev_major=self.dev_major, dev_minor=self.dev_minor, xattrs=self.xattrs, nlink=nlink,
                     digest=self.digest, chunks=chunks)


def _data_chunk(raw: Mapping[str, Any], what: str) -> _RawChunk:
    get = raw.get
    file_offset, size, offset, inner = get("chunkOffset", 0), get("chunkSize", 0), get("offset", 0), \
        get("innerOffset", 0)
    if type(file_offset) is int and type(size) is int and type(offset) is int and type(inner) is int \
            and 0 <= file_offset <= MAX_INT and 0 <= size <= MAX_INT and 0 <= offset <= MAX_INT \
            and 0 <= inner <= MAX_INT:  # the usual case, checked inline (a big TOC has 100k of these)
        return _RawChunk(file_offset, size, offset, inner, digest_field(raw, "chunkDigest", what))
    return _RawChunk(
        file_offset=int_field(raw, "chunkOffset", what),
        size=int_field(raw, "chunkSize", what),
        blob_offset=int_field(raw, "offset", what),
        inner_offset=int_field(raw, "innerOffset", what),
        digest=digest_field(raw, "chunkDigest", what),
    )


def _finish_chunks(p: _Pending, offsets: list[int], toc_offset: int, what: str) -> tuple[Chunk, ...]:
    e = p
    if e.size == 0:
        return ()
    if not p.chunks:
        raise FormatError(f"{what}: regular file {e.name!r} has {e.size} bytes but no payload offset")
    out: list[Chunk] = []
    for rc in p.chunks:
        size = rc.size or e.size - rc.file_offset
        if not 0 < rc.blob_offset < toc_offset:
            raise FormatError(f"{what}: file {e.name!r}: chunk offset {rc.blob_offset} is outside the "
                              f"payload area [1, {toc_offset})")
        nxt = offsets[bisect.bisect_right(offsets, rc.blob_offset)] if offsets[-1] > rc.blob_offset \
            else toc_offset
        blob_size = nxt - rc.blob_offset
        if rc.inner_offset + size > _MAX_DEFLATE_RATIO * blob_size:
            raise FormatError(f"{what}: file {e.name!r}: chunk at {rc.blob_offset} claims "
                              f"{rc.inner_offset + size} bytes from only {blob_size} compressed bytes")
        digest = rc.digest
        if digest is None and len(p.chunks) == 1:
            digest = e.digest  # a single-chunk file: the file digest is the chunk digest
        out.append(Chunk(file_offset=rc.file_offset, size=size, blob_offset=rc.blob_offset,
                         blob_size=blob_size, compression=Compression.GZIP, digest=digest,
                         inner_offset=rc.inner_offset))
    return tuple(out)


def _entry(raw: Mapping[str, Any], type_: EntryType, name: str, what: str) -> _Pending:
    link = str_field(raw, "linkName", what)
    if type_ is EntryType.HARDLINK:
        link = normalize_name(link, allow_root=False)
    elif type_ is EntryType.SYMLINK:
        if not link:
            raise FormatError(f"{what}: symlink without a target")
    else:
        link = ""
    size = int_field(raw, "size", what) if type_ is EntryType.REG else 0
    dev = type_ in (EntryType.CHAR, EntryType.BLOCK)
    get = raw.get
    mode, uid, gid = get("mode", 0), get("uid", 0), get("gid", 0)
    if not (type(mode) is int and type(uid) is int and type(gid) is int and 0 <= mode <= MAX_INT
            and 0 <= uid <= _MAX_ID and 0 <= gid <= _MAX_ID):  # else the field readers say what is wrong
        mode, uid, gid = int_field(raw, "mode", what), int_field(raw, "uid", what, hi=_MAX_ID), \
            int_field(raw, "gid", what, hi=_MAX_ID)
    return _Pending(
        name, type_, mode & 0o7777, uid, gid, mtime_ns_field(raw, what), size, link,
        int_field(raw, "devMajor", what, hi=_MAX_ID) if dev else 0,
        int_field(raw, "devMinor", what, hi=_MAX_ID) if dev else 0,
        xattrs_field(raw, what),
        digest_field(raw, "digest", what) if type_ is EntryType.REG else None,
    )


def _load_json(text: str, what: str) -> list[Any]:
    def no_constants(c: str) -> Any:
        raise FormatError(f"{what}: JSON constant {c} is not allowed")

    try:
        doc = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{what}: TOC JSON is invalid: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{what}: TOC JSON is not an object")
    if doc.get("version") != 1 or type(doc.get("version")) is not int:
        raise FormatError(f"{what}: TOC version {doc.get('version')!r}, expected 1")
    entries = doc.get("entries")
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise FormatError(f"{what}: TOC entries is not a list")
    return entries


def parse_toc(toc_member: bytes, *, blob_size: int, layer_digest: str, max_toc_bytes: int,
              expected_toc_digest: str | None = None, toc_offset: int | None = None) -> LayerIndex:
    """Parse the TOC gzip member (blob[toc_range(...)]) of a `blob_size`-byte layer.

    toc_offset: where the member starts in the blob; default blob_size - 51 - len(toc_member),
      i.e. an eStargz footer. Pass the footer's offset for legacy stargz blobs.
    expected_toc_digest: the layer's `containerd.io/snapshot/stargz/toc.digest` annotation; a
      different sha256 of the TOC JSON raises DigestMismatch naming the layer.
    """
    what = f"stargz TOC of layer {layer_digest}"
    if toc_offset is None:
        toc_offset = blob_size - FOOTER_SIZE - len(toc_member)
    if toc_offset < 0 or toc_offset + len(toc_member) > blob_size:
        raise FormatError(f"{what}: TOC member of {len(toc_member)} bytes at {toc_offset} does not fit "
                          f"a {blob_size}-byte blob")
    data = _toc_json(toc_member, layer_digest, max_toc_bytes)
    toc_digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if expected_toc_digest is not None and expected_toc_digest != toc_digest:
        raise DigestMismatch(f"{what}: TOC digest is {toc_digest}, the layer's annotation says "
                             f"{expected_toc_digest}")
    with gc_paused():
        # The JSON is as big as the index: hold one copy of it at a time (bytes, then text), never
        # while the objects are built.
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{what}: TOC JSON is invalid: {str(exc)[:200]}") from None
        del data
        raws = _load_json(text, what)
        del text
        return _build(raws, what, layer_digest, toc_offset, toc_digest)


def _build(raws: list[Any], what: str, layer_digest: str, toc_offset: int, toc_digest: str) -> LayerIndex:
    """Builds the index from the TOC's entries, emptying `raws` as it goes (each JSON object is
    freed once read, so the peak memory is not the JSON objects plus the index)."""
    pending: list[_Pending] = []
    by_name: dict[str, _Pending] = {}
    offsets: set[int] = set()
    last_reg: _Pending | None = None
    for i in range(len(raws)):
        raw, raws[i] = raws[i], None
        ewhat = f"{what}, entry {i}"
        if not isinstance(raw, dict):
            raise FormatError(f"{ewhat}: not an object")
        kind = str_field(raw, "type", ewhat)
        if kind == "chunk":
            if last_reg is None:
                raise FormatError(f"{ewhat}: chunk entry does not follow a regular file")
            cname = str_field(raw, "name", ewhat)
            if cname and normalize_name(cname) != last_reg.name:
                raise FormatError(f"{ewhat}: chunk of {cname!r} follows file {last_reg.name!r}")
            rc = _data_chunk(raw, ewhat)
            last_reg.chunks.append(rc)
            offsets.add(rc.blob_offset)
            continue
        if kind not in _TYPES:
            raise FormatError(f"{ewhat}: unknown entry type {kind!r}")
        type_ = _TYPES[kind]
        name = _name(str_field(raw, "name", ewhat))
        ewhat = f"{what}, entry {name!r}"
        if name in by_name:
            raise FormatError(f"{ewhat}: listed twice")
        if name == "" and type_ is not EntryType.DIR:
            raise FormatError(f"{ewhat}: the root must be a directory, not {kind}")
        p = _entry(raw, type_, name, ewhat)
        pending.append(p)
        by_name[name] = p
        last_reg = None
        if type_ is EntryType.REG:
            last_reg = p
            if p.size > 0:
                rc = _data_chunk(raw, ewhat)
                if rc.file_offset != 0:
                    raise FormatError(f"{ewhat}: first chunk starts at file offset {rc.file_offset}")
                p.chunks.append(rc)
                offsets.add(rc.blob_offset)
            elif raw.get("chunkSize") or raw.get("innerOffset"):
                raise FormatError(f"{ewhat}: empty file with chunk fields")

    sorted_offsets = sorted(offsets)
    # Hard-link groups: resolve each link to the entry it finally names (memoized, so a long chain
    # of links costs linear time, and a cycle is caught).
    group_size: dict[str, int] = {}
    resolved: dict[str, str] = {}
    for hl in pending:
        if hl.type is not EntryType.HARDLINK or hl.name in resolved:
            continue
        walk = [hl.name]
        seen = {hl.name}
        target = hl.link_target
        while True:
            if target in resolved:
                target = resolved[target]
                break
            t = by_name.get(target)
            if t is None:
                raise FormatError(f"{what}: hard link {walk[-1]!r} names {target!r}, which is not in the layer")
            if t.type is not EntryType.HARDLINK:
                break
            if target in seen:
                raise FormatError(f"{what}: hard link {hl.name!r} is part of a link cycle")
            walk.append(target)
            seen.add(target)
            target = t.link_target
        if by_name[target].type is EntryType.DIR:
            raise FormatError(f"{what}: hard link {hl.name!r} names directory {target!r}")
        for name in walk:
            resolved[name] = target
    for target in resolved.values():
        group_size[target] = group_size.get(target, 1) + 1
    subdirs: dict[str, int] = {}
    for p in pending:
        if not p.name:
            continue
        parent_name = p.name.rpartition("/")[0]
        parent = by_name.get(parent_name)
        if parent is not None:
            if parent.type is not EntryType.DIR:
                raise FormatError(f"{what}: {p.name!r} is inside {parent.name!r}, a {parent.type.value}")
            if p.type is EntryType.DIR:
                subdirs[parent_name] = subdirs.get(parent_name, 0) + 1

    entries: list[Entry] = []
    landmark = Landmark.NONE
    prefetch: list[str] = []
    seen_landmark = False
    by_name.clear()  # from here each _Pending is referenced by `pending` only: free them as entries are made
    for i in range(len(pending)):
        p = pending[i]
        pending[i] = None  # type: ignore[call-overload]
        if p.type is EntryType.DIR:
            nlink = 2 + subdirs.get(p.name, 0)
        else:
            nlink = group_size.get(resolved.get(p.name, p.name), 1)
        if p.type is EntryType.REG:
            e = p.entry(nlink, _finish_chunks(p, sorted_offsets, toc_offset, what))
            try:
                check_chunks(e)
            except FormatError as exc:
                raise FormatError(f"{what}: {exc}") from None
        else:
            e = p.entry(nlink)
        entries.append(e)
        if not seen_landmark and e.type is EntryType.REG:
            if e.name == PREFETCH_LANDMARK:
                landmark, seen_landmark = Landmark.PREFETCH, True
            elif e.name == NO_PREFETCH_LANDMARK:
                landmark, seen_landmark = Landmark.NO_PREFETCH, True
            else:
                prefetch.append(e.name)
    return LayerIndex(
        format=FORMAT_NAME, entries=tuple(entries), blobs=(layer_digest,), landmark=landmark,
        prefetch=tuple(prefetch) if landmark is Landmark.PREFETCH else (), toc_digest=toc_digest,
    )

