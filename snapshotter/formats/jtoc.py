"""The entries list of a JTOC (the eStargz TOC JSON, which zstd:chunked reuses) into `Entry`s.
Pure: JSON bytes in (`decode_toc`), entries out (`read_entries`, then `build_entries`).

Both formats list entries in layer order: a regular file's first chunk rides on its "reg" entry,
each further chunk is a following "chunk" entry. What differs is how a chunk's compressed range
ends and how it is compressed, so the caller finishes each file's chunks (`finish`); everything
else is one set of rules here:
- names are normalized; a name listed twice, a root that is not a directory, an entry under a
  listed non-directory, an unknown type, a chunk that does not follow a non-empty regular file
  (or names another), an empty file with chunk fields: FormatError;
- hard links must end, through any chain of links, at a non-directory of the layer (no cycles);
  every name of a hard-link group gets the group's size as nlink; a directory gets 2 + the
  subdirectories the TOC lists;
- the first landmark file (`.prefetch.landmark` / `.no.prefetch.landmark`) sets the layer's
  landmark; with the prefetch one, the regular files listed before it are the prefetch list.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from snapshotter.errors import FormatError
from snapshotter.formats.index import (
    NO_PREFETCH_LANDMARK,
    NO_XATTRS,
    PREFETCH_LANDMARK,
    SHARED_MODES,
    TYPE_BLOCK,
    TYPE_CHAR,
    Chunk,
    Entry,
    EntryType,
    Landmark,
    check_chunks,
    normalize_name,
)
from snapshotter.formats.index import TYPE_DIR as _DIR
from snapshotter.formats.index import TYPE_HARDLINK as _HARDLINK
from snapshotter.formats.index import TYPE_REG as _REG
from snapshotter.formats.index import TYPE_SYMLINK as _SYMLINK
from snapshotter.formats.toc_fields import (
    DIGEST_RE,
    MAX_INT,
    digest_value,
    int_value,
    mtime_ns_value,
    rfc3339_ns,
    str_value,
    xattrs_value,
)

MAX_ID = (1 << 32) - 1
TYPES = {t.value: t for t in EntryType}


_NON_ASCII = re.compile(rb"[\x80-\xff]+")
_PIECE = 1 << 16  # json_text looks for non-ASCII bytes only in pieces that have some


def _json_escape(m: re.Match[bytes]) -> str:
    """A run of non-ASCII bytes (UTF-8) as JSON \\u escapes (UTF-16 code units: characters
    beyond the BMP become surrogate pairs)."""
    data, start = m.string, m.start()
    before = start
    while before > 0 and data[before - 1] == 0x5C:  # an odd run of backslashes escapes what follows
        before -= 1
    if (start - before) % 2:
        raise ValueError(f"a backslash escapes the non-ASCII character at byte {start}")
    units = m.group().decode("utf-8").encode("utf-16-be")
    return "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2))


def json_text(data: bytes, what: str) -> str:
    """The TOC JSON (UTF-8) as a str of ASCII characters only: each non-ASCII character (JSON
    allows them only inside strings) becomes its \\u escape, which json.loads turns back into
    the same character. A str takes 2 or 4 bytes per character as soon as one is not Latin-1, so
    one such file name would otherwise double or quadruple the memory of a whole TOC's text while
    it is parsed. Invalid UTF-8 is a FormatError."""
    try:
        if data.isascii():
            return data.decode("ascii")
        parts: list[str] = []
        done = 0  # data[:done] is in parts
        size = len(data)
        for lo in range(0, size, _PIECE):
            hi = min(lo + _PIECE, size)
            if hi <= done or data[lo:hi].isascii():
                continue
            end = hi
            while end < size and data[end] >= 0x80:  # a run of non-ASCII bytes stays whole
                end += 1
            for m in _NON_ASCII.finditer(data, max(lo, done), end):
                parts.append(data[done:m.start()].decode("ascii"))
                parts.append(_json_escape(m))
                done = m.end()
        parts.append(data[done:].decode("ascii"))
        return "".join(parts)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise FormatError(f"{what}: TOC JSON is invalid: {str(exc)[:200]}") from None


def load_toc_json(text: str, what: str) -> dict[str, Any]:
    """The TOC document: a JSON object with "version": 1 and, if present, an "entries" list.
    NaN / Infinity and malformed JSON are FormatErrors."""
    def no_constants(c: str) -> Any:
        raise FormatError(f"{what}: JSON constant {c} is not allowed")

    try:
        doc = json.loads(text, parse_constant=no_constants)
    except FormatError:
        raise
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{what}: TOC JSON is invalid: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{what}: TOC JSON is not an object")
    if type(doc.get("version")) is not int or doc.get("version") != 1:
        raise FormatError(f"{what}: TOC version {doc.get('version')!r}, expected 1")
    if not isinstance(doc.get("entries", []), list):
        raise FormatError(f"{what}: TOC entries is not a list")
    return doc


_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
_Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
# The types a TOC entry may have, as a Literal so the typed decoder gives every entry of a type the
# same string (one per entry cost 0.5 MB for 11k entries). Others are read the loose way, whose
# reader names them.
_TocType = Literal["", "chunk", "dir", "reg", "symlink", "hardlink", "char", "block", "fifo"]


class RawEntry(msgspec.Struct, gc=False):
    """One TOC entry's fields as the JSON gives them; an absent field has the default
    (`endOffset`: UNSET, so that its presence shows). From `decode_toc`'s typed decoder every
    value has its annotated type and range; from its fallback a value is whatever json.loads
    made of it, and `read_entries` checks each field it uses either way."""

    name: str = ""
    type: _TocType = ""
    size: _Count = 0
    modtime: str = ""
    linkName: str = ""
    mode: _Count = 0
    uid: _Id = 0
    gid: _Id = 0
    devMajor: _Id = 0
    devMinor: _Id = 0
    xattrs: dict[str, str] | None = None
    digest: str | None = None
    offset: _Count = 0
    innerOffset: _Count = 0
    chunkOffset: _Count = 0
    chunkSize: _Count = 0
    chunkDigest: str | None = None
    chunkType: str = ""
    endOffset: _Count | msgspec.UnsetType = msgspec.UNSET


_RAW_FIELDS = frozenset(RawEntry.__struct_fields__)


class _TypedToc(msgspec.Struct):
    version: Literal[1]
    entries: list[RawEntry] = []
    tarSplitDigest: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_TYPED_TOC = msgspec.json.Decoder(_TypedToc)


@dataclass
class TocDocument:
    """`decode_toc`'s result: the entries in TOC order (None for an item that is not a JSON
    object), and whether the document has a "tarSplitDigest" (zstd:chunked's layout guess).
    checked: the typed decoder made the entries, so every field has its annotated type and range
    (`read_entries` then checks only what the annotations do not say); not part of equality."""

    entries: list[RawEntry | None]
    has_tar_split: bool
    checked: bool = field(default=False, compare=False)


def _is_utf8(data: bytes) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for lo in range(0, len(data), _PIECE):  # piecewise: never one str of the whole TOC
            decoder.decode(data[lo:lo + _PIECE])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def decode_toc(data: bytes, what: str) -> TocDocument:
    """The TOC document (UTF-8 JSON bytes), as `decode_toc_loose` reads it and failing as it does.

    Most TOCs go through a typed decoder that checks each entry's field types and ranges as it
    builds them (several times faster than json.loads and then checking dicts). What it refuses
    (null fields, wrong types, values out of range, lone surrogates, malformed JSON, ...) is read
    again by `decode_toc_loose`, the reference, whose result or error is the answer: the typed
    decoder only ever answers alone for documents that both read alike."""
    typed = typed_toc(data)
    return typed if typed is not None else decode_toc_loose(data, what)


def typed_toc(data: bytes) -> TocDocument | None:
    """The document by the typed decoder, or None where it refuses the document. It does not
    check the UTF-8 of what it skips (unknown keys), so that is checked first."""
    if not (data.isascii() or _is_utf8(data)):
        return None
    try:
        doc = _TYPED_TOC.decode(data)
    except (msgspec.DecodeError, RecursionError):  # msgspec.ValidationError is a DecodeError
        return None
    entries: list[RawEntry | None] = doc.entries  # type: ignore[assignment]  # list is invariant
    return TocDocument(entries, doc.tarSplitDigest is not msgspec.UNSET, checked=True)


def decode_toc_loose(data: bytes, what: str) -> TocDocument:
    """The document by json.loads (`load_toc_json`'s rules and errors); each entry's known
    fields are kept as json.loads made them (None for an item that is not an object)."""
    doc = load_toc_json(json_text(data, what), what)
    raws = doc.get("entries") or []
    for i, raw in enumerate(raws):  # in place: the dicts are freed as they are read
        raws[i] = RawEntry(**{k: v for k, v in raw.items() if k in _RAW_FIELDS}) if isinstance(raw, dict) else None
    return TocDocument(raws, "tarSplitDigest" in doc)


@dataclass(slots=True)
class RawChunk:
    """A chunk as the TOC gives it, before its compressed range is known."""

    file_offset: int
    size: int  # 0: up to the next chunk / the end of the file
    blob_offset: int
    inner_offset: int
    digest: str | None
    zeros: bool = False  # zstd:chunked chunkType "zeros"


@dataclass(slots=True)
class PendingEntry:
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
    chunks: list[RawChunk] = field(default_factory=list)
    end_offset: int = 0  # zstd:chunked (containers/storage) endOffset: where the last chunk ends

    def entry(self, nlink: int, chunks: tuple[Chunk, ...] = ()) -> Entry:
        # Positional, in Entry's field order: keywords cost as much again as the call (one per file).
        return Entry(self.name, self.type, self.mode, self.uid, self.gid, self.mtime_ns, self.size,
                     self.link_target, self.dev_major, self.dev_minor, self.xattrs, nlink, self.digest, chunks)


@dataclass(frozen=True)
class JtocDialect:
    """What a format reads beyond eStargz's keys: `chunkType` ("" or "zeros") and `endOffset`."""

    chunk_types: bool = False
    end_offsets: bool = False


ESTARGZ = JtocDialect()
ZSTD_CHUNKED = JtocDialect(chunk_types=True, end_offsets=True)

FinishChunks = Callable[[PendingEntry, list[int]], tuple[Chunk, ...]]


class _At:
    """`what` for the entry being read, formatted only when an error message needs it (a big TOC
    has 100k entries, nearly all fine): "<what>, entry 7" or "<what>, entry 'etc/passwd'". One is
    reused for every entry (`where` moves on), so a message must be formatted when raised."""

    __slots__ = ("what", "where")

    def __init__(self, what: str, where: int | str) -> None:
        self.what, self.where = what, where

    def __str__(self) -> str:
        return f"{self.what}, entry {self.where!r}" if isinstance(self.where, str) else \
            f"{self.what}, entry {self.where}"


def _plain_str(v: Any, key: str, what: object) -> str:
    """str_value, with the usual case (a string without NUL) checked inline."""
    if type(v) is str and "\x00" not in v:
        return v
    return str_value(v, key, what)


def _digest(v: Any, key: str, what: object) -> str | None:
    """digest_value, with a well-formed digest checked inline."""
    if type(v) is str and DIGEST_RE.fullmatch(v) is not None:
        return v
    return digest_value(v, key, what)


def _chunk(raw: RawEntry, what: object, dialect: JtocDialect, checked: bool,
           file_digest: str | None = None) -> RawChunk:
    """The chunk fields of `raw`. checked: see TocDocument. file_digest: the file's digest, already
    checked; a chunk digest equal to it is that same string, not checked again."""
    zeros = False
    if dialect.chunk_types:
        ctype = str_value(raw.chunkType, "chunkType", what)
        if ctype not in ("", "zeros"):
            raise FormatError(f"{what}: unknown chunkType {ctype!r}")
        zeros = ctype == "zeros"
    file_offset, size, offset, inner = raw.chunkOffset, raw.chunkSize, raw.offset, raw.innerOffset
    if checked or (type(file_offset) is int and type(size) is int and type(offset) is int and type(inner) is int
                   and 0 <= file_offset <= MAX_INT and 0 <= size <= MAX_INT and 0 <= offset <= MAX_INT
                   and 0 <= inner <= MAX_INT):  # the usual case, checked inline (a big TOC has 100k of these)
        digest = raw.chunkDigest
        if digest is None or digest != file_digest:
            digest = _digest(digest, "chunkDigest", what)
        else:
            digest = file_digest  # one string for a one-chunk file's two equal digests (~1 MiB per 10k files)
        return RawChunk(file_offset, size, offset, inner, digest, zeros)
    return RawChunk(
        file_offset=int_value(file_offset, "chunkOffset", what),
        size=int_value(size, "chunkSize", what),
        blob_offset=int_value(offset, "offset", what),
        inner_offset=int_value(inner, "innerOffset", what),
        digest=digest_value(raw.chunkDigest, "chunkDigest", what),
        zeros=zeros,
    )


_DEVICES = (TYPE_CHAR, TYPE_BLOCK)


def _pending(raw: RawEntry, type_: EntryType, name: str, what: object, checked: bool) -> PendingEntry:
    link = raw.linkName
    if link or not checked:  # a checked empty string is all most entries have
        link = _plain_str(link, "linkName", what)
    if type_ is _HARDLINK:
        link = normalize_name(link, allow_root=False)
    elif type_ is _SYMLINK:
        if not link:
            raise FormatError(f"{what}: symlink without a target")
    else:
        link = ""
    size = 0
    if type_ is _REG:
        size = raw.size
        if not checked and (type(size) is not int or not 0 <= size <= MAX_INT):
            size = int_value(size, "size", what)
    mode, uid, gid = raw.mode, raw.uid, raw.gid
    if not (checked or (type(mode) is int and type(uid) is int and type(gid) is int and 0 <= mode <= MAX_INT
                        and 0 <= uid <= MAX_ID and 0 <= gid <= MAX_ID)):  # else the field readers say what is wrong
        mode, uid, gid = int_value(mode, "mode", what), int_value(uid, "uid", what, hi=MAX_ID), \
            int_value(gid, "gid", what, hi=MAX_ID)
    modtime = raw.modtime
    try:
        mtime_ns = rfc3339_ns(modtime) if type(modtime) is str and modtime and "\x00" not in modtime \
            else mtime_ns_value(modtime, what)
    except ValueError:
        mtime_ns = mtime_ns_value(modtime, what)  # raises, naming the entry
    dev_major = dev_minor = 0
    if type_ in _DEVICES:
        dev_major = int_value(raw.devMajor, "devMajor", what, hi=MAX_ID)
        dev_minor = int_value(raw.devMinor, "devMinor", what, hi=MAX_ID)
    digest = None
    if type_ is _REG:
        digest = _digest(raw.digest, "digest", what)
    mode &= 0o7777
    return PendingEntry(name, type_, SHARED_MODES.setdefault(mode, mode), uid, gid, mtime_ns, size, link,
                        dev_major, dev_minor, NO_XATTRS if raw.xattrs is None else xattrs_value(raw.xattrs, what),
                        digest)


@dataclass
class TocEntries:
    """`read_entries`'s result: the entries in TOC order, by name, and every payload offset the
    TOC names, sorted (a chunk's compressed range ends at the next one)."""

    pending: list[PendingEntry]
    by_name: dict[str, PendingEntry]
    offsets: list[int]


def read_entries(raws: list[RawEntry | None], what: str, dialect: JtocDialect, *, checked: bool = False) -> TocEntries:
    """The TOC's entries (`decode_toc`) with their raw chunks. Empties `raws` as it goes: each
    entry's fields are freed once read, so the peak memory is not the fields plus the entries.
    checked: `TocDocument.checked` (the same errors either way; fewer checks to get there)."""
    pending: list[PendingEntry] = []
    by_name: dict[str, PendingEntry] = {}
    offsets: set[int] = set()
    last_reg: PendingEntry | None = None
    at = _At(what, 0)
    types, end_offsets = TYPES, dialect.end_offsets
    for i in range(len(raws)):
        raw, raws[i] = raws[i], None
        at.where = i
        if raw is None:
            raise FormatError(f"{at}: not an object")
        kind = raw.type if checked else _plain_str(raw.type, "type", at)
        if kind == "chunk":
            if last_reg is None or last_reg.size == 0:
                raise FormatError(f"{at}: chunk entry does not follow a non-empty regular file")
            cname = _plain_str(raw.name, "name", at)
            if cname and normalize_name(cname) != last_reg.name:
                raise FormatError(f"{at}: chunk of {cname!r} follows file {last_reg.name!r}")
            rc = _chunk(raw, at, dialect, checked)
            last_reg.chunks.append(rc)
            offsets.add(rc.blob_offset)
            continue
        type_ = types.get(kind)
        if type_ is None:
            raise FormatError(f"{at}: unknown entry type {kind!r}")
        name = raw.name
        if type(name) is str and len(name) > 1 and name[-1] == "/":
            name = name[:-1]  # a directory as tar names it: normal if the rest is plain (else the slow way below)
        if not (type(name) is str and name and name[0] not in "./" and name[-1] not in "./" and "/." not in name
                and "//" not in name and "\x00" not in name):  # else not a plain normal name: the slow way
            name = normalize_name(str_value(raw.name, "name", at))
        at.where = name
        if name in by_name:
            raise FormatError(f"{at}: listed twice")
        if name == "" and type_ is not _DIR:
            raise FormatError(f"{at}: the root must be a directory, not {kind}")
        p = _pending(raw, type_, name, at, checked)
        pending.append(p)
        by_name[name] = p
        last_reg = None
        if type_ is _REG:
            last_reg = p
            if p.size > 0:
                rc = _chunk(raw, at, dialect, checked, p.digest)
                if rc.file_offset != 0:
                    raise FormatError(f"{at}: first chunk starts at file offset {rc.file_offset}")
                p.chunks.append(rc)
                offsets.add(rc.blob_offset)
                if end_offsets:
                    end = raw.endOffset
                    p.end_offset = int_value(None if end is msgspec.UNSET else end, "endOffset", at)
                    if p.end_offset:
                        offsets.add(p.end_offset)
            elif raw.chunkSize or raw.innerOffset:
                raise FormatError(f"{at}: empty file with chunk fields")
    return TocEntries(pending, by_name, sorted(offsets))


def _link_nlinks(pending: list[PendingEntry], by_name: Mapping[str, PendingEntry], what: str) -> dict[str, int]:
    """Every name in a hard-link group (the links and the entry they end at) -> the group's size.
    Each link is resolved to the entry it finally names once, memoized, so a long chain of links
    costs linear time and a cycle is caught."""
    resolved: dict[str, str] = {}
    for hl in pending:
        if hl.type is not _HARDLINK or hl.name in resolved:
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
            if t.type is not _HARDLINK:
                break
            if target in seen:
                raise FormatError(f"{what}: hard link {hl.name!r} is part of a link cycle")
            walk.append(target)
            seen.add(target)
            target = t.link_target
        if by_name[target].type is _DIR:
            raise FormatError(f"{what}: hard link {hl.name!r} names directory {target!r}")
        for name in walk:
            resolved[name] = target
    group_size: dict[str, int] = {}
    for target in resolved.values():
        group_size[target] = group_size.get(target, 1) + 1
    nlinks = {name: group_size[target] for name, target in resolved.items()}
    nlinks.update(group_size)
    return nlinks


def _subdirectories(pending: list[PendingEntry], by_name: Mapping[str, PendingEntry], what: str) -> dict[str, int]:
    """Directory name -> how many subdirectories the TOC lists in it; an entry under a listed
    non-directory is a FormatError."""
    subdirs: dict[str, int] = {}
    for p in pending:
        if not p.name:
            continue
        parent_name = p.name.rpartition("/")[0]
        parent = by_name.get(parent_name)
        if parent is not None:
            if parent.type is not _DIR:
                raise FormatError(f"{what}: {p.name!r} is inside {parent.name!r}, a {parent.type.value}")
            if p.type is _DIR:
                subdirs[parent_name] = subdirs.get(parent_name, 0) + 1
    return subdirs


def build_entries(toc: TocEntries, finish: FinishChunks,
                  what: str) -> tuple[tuple[Entry, ...], Landmark, tuple[str, ...]]:
    """(entries in TOC order, landmark, prefetch list) from `read_entries`'s result; `finish`
    turns a non-empty regular file's raw chunks into Chunks (given the sorted payload offsets).
    Empties `toc` as it goes."""
    pending, by_name, offsets = toc.pending, toc.by_name, toc.offsets
    nlinks = _link_nlinks(pending, by_name, what)
    subdirs = _subdirectories(pending, by_name, what)
    by_name.clear()  # from here each entry is referenced by `pending` only: free them as entries are made
    entries: list[Entry] = []
    landmark = Landmark.NONE
    prefetch: list[str] = []
    seen_landmark = False
    for i in range(len(pending)):
        p = pending[i]
        pending[i] = None  # type: ignore[call-overload]
        type_, name = p.type, p.name
        if type_ is _REG:
            e = p.entry(nlinks.get(name, 1), finish(p, offsets) if p.size else ())
            try:
                check_chunks(e)
            except FormatError as exc:
                raise FormatError(f"{what}: {exc}") from None
            if not seen_landmark:
                if name == PREFETCH_LANDMARK:
                    landmark, seen_landmark = Landmark.PREFETCH, True
                elif name == NO_PREFETCH_LANDMARK:
                    landmark, seen_landmark = Landmark.NO_PREFETCH, True
                else:
                    prefetch.append(name)
        else:
            e = p.entry(2 + subdirs.get(name, 0) if type_ is _DIR else nlinks.get(name, 1))
        entries.append(e)
    return tuple(entries), landmark, tuple(prefetch) if landmark is Landmark.PREFETCH else ()
