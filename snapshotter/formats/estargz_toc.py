"""Read an eStargz / legacy stargz TOC member into a `LayerIndex`.

The TOC member is one gzip member holding a tar with a single USTAR entry "stargz.index.json"
whose content is the TOC JSON ({"version": 1, "entries": [...]}). Entries are listed in layer
order; a regular file's first chunk is described by its "reg" entry and each further chunk by a
following "chunk" entry. A chunk's compressed range runs from its `offset` to the next larger
payload offset in the TOC (or to the TOC member itself for the last one); `innerOffset` lets
several chunks share one gzip member. The entries list follows the rules in `jtoc.py`, which
zstd:chunked shares; this module reads the TOC member and finishes the gzip chunks.

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

import hashlib
from bisect import bisect_right

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded
from snapshotter.formats.estargz_footer import FOOTER_SIZE, MIN_GZIP_MEMBER
from snapshotter.formats.index import Chunk, Compression, LayerIndex
from snapshotter.formats.inflate import InflateError, gzip_inflater
from snapshotter.formats.jtoc import ESTARGZ, PendingEntry, RawEntry, build_entries, decode_toc, read_entries
from snapshotter.gcpause import gc_paused

TOC_TAR_NAME = "stargz.index.json"
FORMAT_NAME = "estargz"

# Deflate cannot expand data by more than 1032:1; a chunk claiming more bytes than that from its
# compressed range is lying, and would only make us inflate garbage.
_MAX_DEFLATE_RATIO = 1032
_GZIP = Compression.GZIP
# After the JSON the TOC tar holds at most 511 padding bytes and the 1024-byte end marker; allow a
# little more (some writers pad to a record) before calling the member malformed.
_MAX_TOC_TRAILER = 1 << 16


class _Inflater:
    """Pulls exact amounts of output from one gzip member, never more than asked for."""

    def __init__(self, data: bytes, what: str) -> None:
        self._d = gzip_inflater()
        self._pending = data
        self._what = what

    def read(self, n: int) -> bytes:
        d = self._d
        if n <= 0 or d.eof:
            return b""
        try:
            first = d.decompress(self._pending, n)
            self._pending = b""  # the decompressor holds what it did not use yet
            if len(first) >= n or d.eof or d.needs_input:
                return first  # one call gave it all (the TOC JSON, usually): no second copy of it
            out = bytearray(first)
            while len(out) < n and not d.eof and not d.needs_input:
                piece = d.decompress(b"", n - len(out))
                if not piece:
                    break
                out += piece
        except InflateError as exc:
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


def _finish_chunks(p: PendingEntry, offsets: list[int], toc_offset: int, what: str) -> tuple[Chunk, ...]:
    """A gzip chunk's compressed range runs to the next larger payload offset, or to the TOC."""
    raw_chunks = p.chunks
    if not raw_chunks:
        raise FormatError(f"{what}: regular file {p.name!r} has {p.size} bytes but no payload offset")
    single = len(raw_chunks) == 1  # nearly every file: its chunk is returned as soon as it is made
    last_offset = offsets[-1]
    out: list[Chunk] = []
    for rc in raw_chunks:
        blob_offset = rc.blob_offset
        # A one-chunk file's chunk size is the entry's own int (one object per file, not two).
        size = rc.size or (p.size - rc.file_offset if rc.file_offset else p.size)
        if not 0 < blob_offset < toc_offset:
            raise FormatError(f"{what}: file {p.name!r}: chunk offset {blob_offset} is outside the "
                              f"payload area [1, {toc_offset})")
        nxt = offsets[bisect_right(offsets, blob_offset)] if last_offset > blob_offset else toc_offset
        blob_size = nxt - blob_offset
        if rc.inner_offset + size > _MAX_DEFLATE_RATIO * blob_size:
            raise FormatError(f"{what}: file {p.name!r}: chunk at {blob_offset} claims "
                              f"{rc.inner_offset + size} bytes from only {blob_size} compressed bytes")
        digest = rc.digest
        if digest is None and single:
            digest = p.digest  # a single-chunk file: the file digest is the chunk digest
        chunk = Chunk(rc.file_offset, size, blob_offset, blob_size, _GZIP, digest, rc.inner_offset)
        if single:
            return (chunk,)
        out.append(chunk)
    return tuple(out)


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
        doc = decode_toc(data, what)
        del data  # as big as the index: never held while the entries are built
        return _build(doc.entries, what, layer_digest, toc_offset, toc_digest, doc.checked)


def _build(raws: list[RawEntry | None], what: str, layer_digest: str, toc_offset: int,
           toc_digest: str, checked: bool) -> LayerIndex:
    toc = read_entries(raws, what, ESTARGZ, checked=checked)
    entries, landmark, prefetch = build_entries(
        toc, lambda p, offs: _finish_chunks(p, offs, toc_offset, what), what)
    return LayerIndex(format=FORMAT_NAME, entries=entries, blobs=(layer_digest,), landmark=landmark,
                      prefetch=prefetch, toc_digest=toc_digest)
