"""Resolve a layer lazily: from (image, layer digest) to its LayerIndex, with few round trips.

Order of requests for one layer: GET the last TAIL_BYTES (a suffix range, whose answer also gives
the blob's size; they hold the footer and, for small layers, the whole TOC), or as many as the
layer's tail-size hint says (formats/tail_hint.py: our converter's annotation; at most
max_toc_bytes + TAIL_BYTES), then GET the TOC range if the tail did not hold it. The footer
decides the format: eStargz (51-byte footer), legacy stargz (47), zstd:chunked (either layout).
Nydus layers are told apart by their labels: a data blob layer needs only its size (HEAD), the
bootstrap layer (small) is fetched whole: with a suffix range of BOOTSTRAP_FIRST_READ bytes, whose
answer is the whole layer when it is smaller and gives the size otherwise (then the rest follows,
unless the size is over the limit). Anything else is `NotLazy`, and the caller falls back to a
full pull of that layer.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded, SnapshotterError
from snapshotter.fetch.client import RegistryClient
from snapshotter.formats import estargz, zstdchunked
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.metadata_parse import (
    ESTARGZ,
    NYDUS_BLOB,
    NYDUS_BOOTSTRAP,
    ZSTD_CHUNKED,
    MetadataParse,
    parse_metadata,
    position_doc,
)
from snapshotter.remote.labels import LayerRef
from snapshotter.remote.spare_replies import SpareWait

TAIL_BYTES = 64 * 1024
# A bootstrap layer up to this size is fetched in one round trip (no HEAD first). About 60 bytes
# per file (gzipped RAFS v6): 11,400 files take 0.7 MB, so this covers some 140,000.
BOOTSTRAP_FIRST_READ = 8 << 20

# Told of a layer's metadata bytes and how they parse, just before the daemon parses them, with
# the image's layers from this one up (the spare mount process parses the same bytes meanwhile
# and, from the lowest layer's list, builds the image's tree ahead: remote/mounts.py preload).
# Must not block. May return a wait for the spare's own parse of them (remote/spare_replies.py):
# when it gives the index, the daemon does not parse.
OnMetadata = Callable[[MetadataParse, bytes, str, tuple[str, ...]], SpareWait | None]  # (parse, data, its key, layers)
# How long a resolve waits for the spare's parse before parsing itself (the spare is stuck or
# busy; it parses 11,000 TOC entries in about 0.1 s); never more than half the resolve's time left.
SPARE_PARSE_WAIT = 10.0


class NotLazy(SnapshotterError):
    """The layer blob is not in a lazily readable format (e.g. plain gzip)."""


@dataclass(frozen=True)
class ParsedMetadata:
    """A layer's parsed metadata: its index here (`index`), or, parsed by the spare mount process,
    only the bytes and how they parse (`metadata`: what remote/store.py `save_metadata` stores).
    toc_digest: the index's."""

    index: LayerIndex | None
    toc_digest: str | None
    metadata: tuple[MetadataParse, bytes] | None = None

    @classmethod
    def of(cls, index: LayerIndex) -> ParsedMetadata:
        return cls(index, index.toc_digest)


@dataclass(frozen=True)
class ResolvedLayer:
    """metadata_bytes: the bytes of the blob the format needs for the tree (footer + TOC, or the
    whole bootstrap layer); what was fetched may be more (the tail read is fixed-size).
    parse_key: `MetadataParse.key` of the parse that made the index (None: nothing was parsed)."""

    ref: LayerRef
    format: str
    blob_size: int
    parsed: ParsedMetadata
    metadata_bytes: int = 0
    parse_key: str | None = None

    @property
    def index(self) -> LayerIndex:
        """The index, when this process parsed it (always, without an `on_metadata` that hands
        the parse to the spare); else a ValueError: the spare parsed `parsed.metadata`."""
        if self.parsed.index is None:
            raise ValueError(f"layer {self.ref.layer_digest}: its metadata was parsed by the spare, not here")
        return self.parsed.index


T = TypeVar("T")


async def _off_loop(parse: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run a parse (CPU work: 0.08-0.15 s for a TOC of 11,000 entries) on a worker thread, so the
    loop keeps serving the other layers' requests meanwhile (their resolves run ahead in it)."""
    return await trio.to_thread.run_sync(functools.partial(parse, *args, **kwargs))


async def _range(client: RegistryClient, ref: LayerRef, tail: bytes, tail_start: int,
                 offset: int, length: int) -> bytes:
    """blob[offset:offset+length], from the tail already fetched when it holds it."""
    if offset >= tail_start:
        return tail[offset - tail_start:offset - tail_start + length]
    return bytes(await client.read_range(ref.image_ref, ref.layer_digest, offset, length))


def _check_toc_digest(ref: LayerRef, toc_digest: str | None) -> None:
    if ref.toc_digest and toc_digest and ref.toc_digest != toc_digest:
        raise DigestMismatch(f"layer {ref.layer_digest}: TOC digest is {toc_digest}, the image's "
                             f"annotation says {ref.toc_digest}")


NYDUS_BLOB_FORMAT = NYDUS_BLOB


async def _parse(ref: LayerRef, p: MetadataParse, data: bytes, on_metadata: OnMetadata | None,
                 expected_toc_digest: str | None = None) -> tuple[ParsedMetadata, str]:
    """(parse, parse key) of `data`: `on_metadata` is told first; then the spare's parse, if it
    was handed the bytes and gives one in SPARE_PARSE_WAIT, else the daemon's, off the loop.
    Either way its TOC digest is checked against the image's (`ref.toc_digest`); the daemon's
    eStargz parse also checks `expected_toc_digest` itself, before the TOC is decoded."""
    key = p.key(data)
    spare_wait = on_metadata(p, data, key, ref.image_layers) if on_metadata is not None else None
    if p.kind == NYDUS_BLOB:  # nothing to parse
        return ParsedMetadata.of(parse_metadata(p, data)), key
    if spare_wait is not None:
        # At most half of what the resolve has left: a stuck spare must not turn into a fallback.
        left = trio.current_effective_deadline() - trio.current_time()
        by_spare = await trio.to_thread.run_sync(spare_wait, max(0.0, min(SPARE_PARSE_WAIT, left / 2)),
                                                 abandon_on_cancel=True)
        if by_spare is not None:
            _check_toc_digest(ref, by_spare.toc_digest)
            return ParsedMetadata(None, by_spare.toc_digest, (p, data)), key
    index = await _off_loop(parse_metadata, p, data, expected_toc_digest=expected_toc_digest)
    _check_toc_digest(ref, index.toc_digest)
    return ParsedMetadata.of(index), key


async def _resolve_nydus(client: RegistryClient, ref: LayerRef, *, max_bootstrap_bytes: int,
                         on_metadata: OnMetadata | None) -> ResolvedLayer:
    """A Nydus data blob layer has no tree of its own (the bootstrap layer describes the image);
    the bootstrap layer is small and fetched whole, then parsed."""
    if ref.nydus_blob:
        size = await client.blob_size(ref.image_ref, ref.layer_digest)
        p = MetadataParse(NYDUS_BLOB, ref.layer_digest, size, 0)
        parsed, key = await _parse(ref, p, b"", on_metadata)  # empty: told so the spare knows the whole image
        return ResolvedLayer(ref, NYDUS_BLOB_FORMAT, size, parsed, 0, key)
    first = max(1, min(BOOTSTRAP_FIRST_READ, max_bootstrap_bytes))
    tail, size = await client.read_tail(ref.image_ref, ref.layer_digest, first)
    if size > max_bootstrap_bytes:
        raise LimitExceeded(f"nydus bootstrap layer {ref.layer_digest} is {size} bytes, over "
                            f"limits.max_bootstrap_bytes ({max_bootstrap_bytes})")
    layer = tail if len(tail) == size else \
        bytes(await client.read_range(ref.image_ref, ref.layer_digest, 0, size - len(tail))) + tail
    if hashlib.sha256(layer).hexdigest() != ref.layer_digest.partition(":")[2]:
        raise DigestMismatch(f"nydus bootstrap layer {ref.layer_digest}: content does not match its digest")

    p = MetadataParse(NYDUS_BOOTSTRAP, ref.layer_digest, size, max_bootstrap_bytes)
    parsed, key = await _parse(ref, p, layer, on_metadata)
    return ResolvedLayer(ref, "nydus", size, parsed, size, key)


def tail_request_bytes(ref: LayerRef, max_toc_bytes: int) -> int:
    """How many bytes the first (suffix) request asks for: TAIL_BYTES, or the layer's hinted
    tail when larger, capped where a TOC that large would be refused anyway."""
    if ref.tail_size is None:
        return TAIL_BYTES
    return max(TAIL_BYTES, min(ref.tail_size, max_toc_bytes + TAIL_BYTES))


async def resolve_layer(client: RegistryClient, ref: LayerRef, *, max_toc_bytes: int,
                        max_bootstrap_bytes: int = 1 << 30, on_metadata: OnMetadata | None = None) -> ResolvedLayer:
    """Fetch and parse the layer's TOC (or Nydus bootstrap). Raises NotLazy, FormatError /
    DigestMismatch / LimitExceeded, or FetchError. on_metadata: see OnMetadata."""
    if ref.nydus_blob or ref.nydus_bootstrap:
        return await _resolve_nydus(client, ref, max_bootstrap_bytes=max_bootstrap_bytes, on_metadata=on_metadata)
    tail, size = await client.read_tail(ref.image_ref, ref.layer_digest, tail_request_bytes(ref, max_toc_bytes))
    if size < estargz.LEGACY_FOOTER_SIZE:
        raise NotLazy(f"layer {ref.layer_digest} is only {size} bytes: no lazy-format footer")
    tail_start = size - len(tail)

    try:
        footer = estargz.parse_footer(tail[-estargz.FOOTER_SIZE:])
    except FormatError:
        footer = None
    if footer is not None:
        offset, length = estargz.toc_range(footer, size)
        if length > max_toc_bytes:
            raise FormatError(f"layer {ref.layer_digest}: TOC of {length} bytes exceeds limits.max_toc_bytes")
        member = await _range(client, ref, tail, tail_start, offset, length)
        p = MetadataParse(ESTARGZ, ref.layer_digest, size, max_toc_bytes, toc_offset=footer.toc_offset)
        parsed, key = await _parse(ref, p, member, on_metadata, expected_toc_digest=ref.toc_digest)
        footer_len = estargz.LEGACY_FOOTER_SIZE if footer.legacy else estargz.FOOTER_SIZE
        return ResolvedLayer(ref, "stargz" if footer.legacy else "estargz", size, parsed, length + footer_len, key)

    try:
        position = zstdchunked.parse_footer(tail, blob_size=size)
    except FormatError:
        position = None
    if position is not None:
        if position.compressed_size > max_toc_bytes:
            raise FormatError(f"layer {ref.layer_digest}: zstd:chunked TOC of {position.compressed_size} bytes "
                              "exceeds limits.max_toc_bytes")
        compressed = await _range(client, ref, tail, tail_start, position.offset, position.compressed_size)
        p = MetadataParse(ZSTD_CHUNKED, ref.layer_digest, size, max_toc_bytes, position=position_doc(position))
        parsed, key = await _parse(ref, p, compressed, on_metadata)
        return ResolvedLayer(ref, "zstdchunked", size, parsed, size - position.offset, key)

    raise NotLazy(f"layer {ref.layer_digest} has no eStargz or zstd:chunked footer (plain gzip/zstd layer?)")
