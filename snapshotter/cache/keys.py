"""Chunk keys and where they live on disk.

A key names the uncompressed bytes of one chunk:
- "sha256:HEX" / "blake3:HEX" (64 lowercase hex digits): content-addressed, so identical chunks
  of different layers and images share one file, `chunks/ALGO/HEX[:2]/HEX`.
- "blob:BLOB@OFFSET+INNER:SIZE" for chunks whose format records no digest: the chunk is named by
  where it sits in its blob (blob digest, compressed offset, inner offset, size). The file is
  `chunks/blob/H[:2]/H` with H = sha256(key), which keeps odd blob ids out of path names.
- "group:HEX" for a read unit of several chunks (reader/units.py): HEX = sha256 of its parts'
  digests in order, joined by ",". The parts' digests fix the bytes, so this too is content
  addressed: a file chunked the same way in two layers is one cache file. `chunks/group/HEX[:2]/HEX`.
- "file:HEX" for the whole of a file of several chunks, stored once all of them are cached
  (fusefs/direct.py): HEX = sha256 of its chunks' keys in order, joined by ",", so it is content
  addressed as its parts are. `chunks/file/HEX[:2]/HEX`.

Anything else is rejected with ValueError, so a hostile TOC digest can never become a path.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

DIGEST_ALGOS = ("sha256", "blake3")
_DIGEST_RE = re.compile(r"^(sha256|blake3):([0-9a-f]{64})$")
BLOB_PREFIX = "blob:"
GROUP_PREFIX = "group:"
_GROUP_RE = re.compile(r"^group:([0-9a-f]{64})$")
FILE_PREFIX = "file:"
_FILE_RE = re.compile(r"^file:([0-9a-f]{64})$")


def blob_key(blob: str, blob_offset: int, inner_offset: int, size: int) -> str:
    """The key of a digest-less chunk: its blob, compressed offset, inner offset and size."""
    if not blob or blob_offset < 0 or inner_offset < 0 or size < 0:
        raise ValueError(f"bad blob chunk position {blob!r}@{blob_offset}+{inner_offset}:{size}")
    return f"{BLOB_PREFIX}{blob}@{blob_offset}+{inner_offset}:{size}"


def group_key(part_digests: Iterable[str]) -> str:
    """The key of a unit of chunks with these digests ("ALGO:hex", in file order)."""
    joined = ",".join(d.lower() for d in part_digests)
    if not joined:
        raise ValueError("a group key needs the digests of its parts")
    return GROUP_PREFIX + hashlib.sha256(joined.encode("ascii", "replace")).hexdigest()


def file_key(part_keys: Iterable[str]) -> str:
    """The key of a whole file whose chunks have these keys (in file order; "zeros:SIZE" for a
    chunk of zeros, which has no key)."""
    joined = ",".join(part_keys)
    if not joined:
        raise ValueError("a file key needs the keys of its chunks")
    return FILE_PREFIX + hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()


def is_digest_key(key: str) -> bool:
    return _DIGEST_RE.match(key) is not None


def relative_path(key: str) -> Path:
    """`chunks/...` path of a key, relative to the cache root. ValueError for malformed keys."""
    m = _DIGEST_RE.match(key)
    if m is not None:
        algo, hexd = m.group(1), m.group(2)
        return Path("chunks", algo, hexd[:2], hexd)
    g = _GROUP_RE.match(key)
    if g is not None:
        return Path("chunks", "group", g.group(1)[:2], g.group(1))
    f = _FILE_RE.match(key)
    if f is not None:
        return Path("chunks", "file", f.group(1)[:2], f.group(1))
    if key.startswith(BLOB_PREFIX) and len(key) > len(BLOB_PREFIX) and "\x00" not in key:
        h = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return Path("chunks", "blob", h[:2], h)
    raise ValueError(f"not a chunk key: {key!r} (want sha256:HEX, blake3:HEX, group:HEX, file:HEX or blob:...)")
