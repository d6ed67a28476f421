"""How a layer's metadata bytes become its LayerIndex, as plain data. Pure.

The daemon parses a lazy layer's metadata (an eStargz TOC member, a zstd:chunked manifest, a
Nydus bootstrap layer) while containerd's Prepare waits; the image's mount process needs the same
index moments later. A `MetadataParse` says everything the parse needs besides the bytes, in a
form that goes through JSON, so a second process (the spare mount process, fusefs/spare.py) can
repeat the parse on its own core at the same time and have the index ready when it is handed the
mount, instead of loading the daemon's persisted copy after the daemon is done.

Contracts:
- `parse_metadata(p, data)` is deterministic: the same `p` and bytes give an equal LayerIndex in
  any process. What only decides whether the parse succeeds (limits, an expected TOC digest) is
  not part of the result.
- `p.key(data)` names that result: equal keys mean equal indexes. It digests the kind, every field
  that shapes the output, and the bytes.
- `MetadataParse.from_doc` treats its input as untrusted: a malformed document is a FormatError.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from snapshotter.errors import FormatError
from snapshotter.formats import estargz, zstdchunked
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.nydus import parse_bootstrap
from snapshotter.formats.nydus_layer import bootstrap_from_layer

ESTARGZ = "estargz"  # legacy stargz too: the footer's toc_offset says where the member starts
ZSTD_CHUNKED = "zstdchunked"
NYDUS_BOOTSTRAP = "nydus-bootstrap"
NYDUS_BLOB = "nydus-blob"  # a Nydus data blob layer: no bytes, an empty index (the bootstrap has the tree)
KINDS = (ESTARGZ, ZSTD_CHUNKED, NYDUS_BOOTSTRAP, NYDUS_BLOB)
KEY_VERSION = 1  # part of every key: bump it when a parse's output changes for the same input


@dataclass(frozen=True)
class MetadataParse:
    """kind: one of KINDS. limit: max_toc_bytes (eStargz, zstd:chunked) or max_bootstrap_bytes
    (Nydus). toc_offset: where an eStargz TOC member starts in the blob. position: a zstd:chunked
    ManifestPosition's fields (`position_doc`)."""

    kind: str
    layer_digest: str
    blob_size: int
    limit: int
    toc_offset: int | None = None
    position: dict[str, Any] | None = None

    def key(self, data: bytes) -> str:
        shape = json.dumps([KEY_VERSION, self.kind, self.layer_digest, self.blob_size, self.toc_offset,
                            self.position], sort_keys=True, separators=(",", ":"))
        h = hashlib.sha256(shape.encode())
        h.update(b"\0")
        h.update(data)
        return h.hexdigest()

    def to_doc(self) -> dict[str, Any]:
        return {"kind": self.kind, "layer_digest": self.layer_digest, "blob_size": self.blob_size,
                "limit": self.limit, "toc_offset": self.toc_offset, "position": self.position}

    @classmethod
    def from_doc(cls, doc: object) -> MetadataParse:
        if not isinstance(doc, dict):
            raise FormatError("metadata parse: not an object")
        kind, digest, size, limit = doc.get("kind"), doc.get("layer_digest"), doc.get("blob_size"), doc.get("limit")
        toc_offset, position = doc.get("toc_offset"), doc.get("position")
        if kind not in KINDS or type(digest) is not str or not _count(size) or not _count(limit) \
                or not (toc_offset is None or _count(toc_offset)) \
                or not (position is None or isinstance(position, dict)):
            raise FormatError(f"metadata parse: malformed description {str(doc)[:200]!r}")
        assert isinstance(size, int) and isinstance(limit, int)
        return cls(kind, digest, size, limit, toc_offset, position)


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


def position_doc(p: zstdchunked.ManifestPosition) -> dict[str, Any]:
    return {"offset": p.offset, "compressed_size": p.compressed_size, "uncompressed_size": p.uncompressed_size,
            "manifest_type": p.manifest_type, "layout": p.layout.value, "checksum": p.checksum,
            "tar_split": list(p.tar_split) if p.tar_split is not None else None}


def _position(doc: dict[str, Any]) -> zstdchunked.ManifestPosition:
    try:
        split = doc.get("tar_split")
        return zstdchunked.ManifestPosition(
            offset=int(doc["offset"]), compressed_size=int(doc["compressed_size"]),
            uncompressed_size=int(doc["uncompressed_size"]), manifest_type=int(doc["manifest_type"]),
            layout=zstdchunked.Layout(doc["layout"]), checksum=doc.get("checksum"),
            tar_split=(int(split[0]), int(split[1]), int(split[2])) if split is not None else None)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise FormatError(f"metadata parse: malformed zstd:chunked position: {exc!r}") from None


def parse_metadata(p: MetadataParse, data: bytes, *, expected_toc_digest: str | None = None) -> LayerIndex:
    """The LayerIndex of `data` (the layer's metadata bytes, as `p` describes them). Raises what
    the format's parser raises (FormatError, DigestMismatch, LimitExceeded). expected_toc_digest:
    checked by eStargz (the TOC digest annotation); the other kinds are checked by the caller."""
    if p.kind == ESTARGZ:
        return estargz.parse_toc(data, blob_size=p.blob_size, layer_digest=p.layer_digest, max_toc_bytes=p.limit,
                                 expected_toc_digest=expected_toc_digest, toc_offset=p.toc_offset)
    if p.kind == ZSTD_CHUNKED:
        return zstdchunked.parse_manifest(data, blob_size=p.blob_size, layer_digest=p.layer_digest,
                                          max_toc_bytes=p.limit,
                                          position=_position(p.position) if p.position is not None else None)
    if p.kind == NYDUS_BOOTSTRAP:
        boot = bootstrap_from_layer(data, max_bootstrap_bytes=p.limit)
        return parse_bootstrap(boot, max_bootstrap_bytes=p.limit)
    if p.kind == NYDUS_BLOB:
        return LayerIndex(NYDUS_BLOB, ())
    raise FormatError(f"metadata parse: unknown kind {p.kind!r}")
