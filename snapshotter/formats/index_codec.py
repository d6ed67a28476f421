"""Persist a LayerIndex as compact JSON, so a mount process needs no registry round trip. Pure.

`dump_index(index) -> bytes` and `load_index(data) -> LayerIndex` round-trip exactly
(`load_index(dump_index(i)) == i`).

Format (UTF-8 JSON, version 1):
    {"version": 1, "format": "estargz", "blobs": [...], "landmark": "none", "prefetch": [...],
     "toc_digest": "sha256:..." | null,
     "entries": [{"name": "etc/passwd", "type": "reg", ...non-default Entry fields...,
                  "xattrs": {"user.k": "<base64>"},
                  "chunks": [[file_offset, size, blob_offset, blob_size, compression, digest|null,
                              inner_offset, blob_index, zeros], ...]}, ...]}
Entry fields equal to their dataclass default are omitted. Entry names are stored as str; names
that are not valid UTF-8 reach us as surrogate-escaped str and are stored escaped the same way
(JSON "\\udcXX"), which `load_index` restores.

`load_index` treats its input as untrusted: any structural problem raises FormatError, and
`max_size` caps the input before parsing.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from snapshotter.errors import FormatError, LimitExceeded
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType, Landmark, LayerIndex, check_chunks

VERSION = 1
DEFAULT_MAX_SIZE = 1 << 30

_ENTRY_INT_FIELDS = ("mode", "uid", "gid", "mtime_ns", "size", "dev_major", "dev_minor", "nlink")
_DEFAULTS = Entry(name="", type=EntryType.REG)


def _chunk_row(c: Chunk) -> list[Any]:
    return [c.file_offset, c.size, c.blob_offset, c.blob_size, c.compression.value, c.digest,
            c.inner_offset, c.blob_index, c.zeros]


def _entry_obj(e: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"name": e.name, "type": e.type.value}
    for f in _ENTRY_INT_FIELDS:
        v = getattr(e, f)
        if v != getattr(_DEFAULTS, f):
            out[f] = v
    if e.link_target:
        out["link_target"] = e.link_target
    if e.digest is not None:
        out["digest"] = e.digest
    if e.xattrs:
        out["xattrs"] = {k: base64.b64encode(v).decode("ascii") for k, v in e.xattrs.items()}
    if e.chunks:
        out["chunks"] = [_chunk_row(c) for c in e.chunks]
    return out


def dump_index(index: LayerIndex) -> bytes:
    """The persisted form of `index` (compact JSON bytes)."""
    doc = {
        "version": VERSION,
        "format": index.format,
        "blobs": list(index.blobs),
        "landmark": index.landmark.value,
        "prefetch": list(index.prefetch),
        "toc_digest": index.toc_digest,
        "entries": [_entry_obj(e) for e in index.entries],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _want(value: object, kind: type | tuple[type, ...], what: str) -> Any:
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(value, bool) and kind is int:
        raise FormatError(f"persisted index: {what} must be int, got bool")
    if not isinstance(value, kind):
        raise FormatError(f"persisted index: {what} has the wrong type ({type(value).__name__})")
    return value


def _nonneg(value: object, what: str) -> int:
    v: int = _want(value, int, what)
    if v < 0:
        raise FormatError(f"persisted index: {what} is negative")
    return v


def _chunk(row: object, what: str) -> Chunk:
    r = _want(row, list, what)
    if len(r) != 9:
        raise FormatError(f"persisted index: {what} has {len(r)} fields, expected 9")
    try:
        compression = Compression(_want(r[4], str, what + " compression"))
    except ValueError:
        raise FormatError(f"persisted index: {what}: unknown compression {r[4]!r}") from None
    digest = r[5]
    if digest is not None:
        _want(digest, str, what + " digest")
    return Chunk(
        file_offset=_nonneg(r[0], what), size=_nonneg(r[1], what), blob_offset=_nonneg(r[2], what),
        blob_size=_nonneg(r[3], what), compression=compression, digest=digest,
        inner_offset=_nonneg(r[6], what), blob_index=_nonneg(r[7], what), zeros=_want(r[8], bool, what),
    )


def _entry(obj: object, pos: int) -> Entry:
    o: Mapping[str, Any] = _want(obj, dict, f"entry {pos}")
    name = _want(o.get("name"), str, f"entry {pos} name")
    what = f"entry {name!r}"
    unknown = set(o) - {"name", "type", "link_target", "digest", "xattrs", "chunks", *_ENTRY_INT_FIELDS}
    if unknown:
        raise FormatError(f"persisted index: {what} has unknown fields {sorted(unknown)}")
    try:
        etype = EntryType(_want(o.get("type"), str, what + " type"))
    except ValueError:
        raise FormatError(f"persisted index: {what} has unknown type {o.get('type')!r}") from None
    ints = {f: _nonneg(o[f], f"{what} {f}") for f in _ENTRY_INT_FIELDS if f in o and f != "mtime_ns"}
    if "mtime_ns" in o:
        ints["mtime_ns"] = _want(o["mtime_ns"], int, what + " mtime_ns")  # may predate the epoch
    digest = o.get("digest")
    if digest is not None:
        _want(digest, str, what + " digest")
    xattrs: Mapping[str, bytes] = MappingProxyType({})
    if "xattrs" in o:
        raw = _want(o["xattrs"], dict, what + " xattrs")
        try:
            xattrs = MappingProxyType({
                _want(k, str, what + " xattr name"): base64.b64decode(_want(v, str, what + " xattr"), validate=True)
                for k, v in raw.items()
            })
        except binascii.Error:
            raise FormatError(f"persisted index: {what} has a bad base64 xattr value") from None
    chunks = tuple(_chunk(r, f"{what} chunk {i}") for i, r in enumerate(_want(o.get("chunks", []), list, what)))
    entry = Entry(
        name=name, type=etype, link_target=_want(o.get("link_target", ""), str, what + " link_target"),
        digest=digest, xattrs=xattrs, chunks=chunks, **ints,
    )
    check_chunks(entry)
    return entry


def load_index(data: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> LayerIndex:
    """The LayerIndex that `dump_index` wrote. Raises FormatError (LimitExceeded over max_size)."""
    if len(data) > max_size:
        raise LimitExceeded(f"persisted index is {len(data)} bytes, over the limit of {max_size}")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"persisted index is not JSON: {exc}") from None
    d: Mapping[str, Any] = _want(doc, dict, "document")
    if d.get("version") != VERSION:
        raise FormatError(f"persisted index has version {d.get('version')!r}, expected {VERSION}")
    try:
        landmark = Landmark(_want(d.get("landmark", "none"), str, "landmark"))
    except ValueError:
        raise FormatError(f"persisted index: unknown landmark {d.get('landmark')!r}") from None
    toc_digest = d.get("toc_digest")
    if toc_digest is not None:
        _want(toc_digest, str, "toc_digest")
    blobs = tuple(_want(b, str, "blob") for b in _want(d.get("blobs", []), list, "blobs"))
    prefetch = tuple(_want(p, str, "prefetch name") for p in _want(d.get("prefetch", []), list, "prefetch"))
    entries = tuple(_entry(e, i) for i, e in enumerate(_want(d.get("entries"), list, "entries")))
    return LayerIndex(
        format=_want(d.get("format"), str, "format"), entries=entries, blobs=blobs, landmark=landmark,
        prefetch=prefetch, toc_digest=toc_digest,
    )
