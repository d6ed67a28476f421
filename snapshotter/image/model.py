"""OCI / Docker image media types and small JSON helpers (no IO).

Descriptors are plain dicts as they appear in manifests and indexes ({"mediaType", "digest",
"size", ...}); helpers here check the fields we rely on and raise `ImageError` naming the
document when they are missing or mistyped.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from snapshotter.errors import SnapshotterError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_LAYER_ND = "application/vnd.oci.image.layer.nondistributable.v1.tar"
OCI_LAYER_ND_GZIP = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
OCI_LAYER_ND_ZSTD = "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_ZSTD = "application/vnd.docker.image.rootfs.diff.tar.zstd"
DOCKER_FOREIGN_GZIP = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
NYDUS_BLOB = "application/vnd.oci.image.layer.nydus.blob.v1"

INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
# Layer media types whose content is a (possibly compressed) tar we can convert.
TAR_LAYER_TYPES = frozenset({OCI_LAYER, OCI_LAYER_GZIP, OCI_LAYER_ZSTD, OCI_LAYER_ND, OCI_LAYER_ND_GZIP,
                             OCI_LAYER_ND_ZSTD, DOCKER_LAYER_GZIP, DOCKER_LAYER_ZSTD, DOCKER_FOREIGN_GZIP,
                             "application/vnd.docker.image.rootfs.diff.tar"})

REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
MAX_JSON_BYTES = 4 << 20  # manifests, indexes and configs

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class ImageError(SnapshotterError):
    """An image (reference, layout, manifest, config or layer) is missing or malformed."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest_syntax(digest: object, what: str) -> str:
    """`digest` if it is "sha256:<64 lowercase hex>" (the only algorithm we write or verify)."""
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise ImageError(f"{what}: digest {digest!r} is not sha256:<64 hex digits>")
    return digest


def encode(doc: Mapping[str, Any]) -> bytes:
    """Compact JSON bytes of a manifest / index / config (key order kept)."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def decode(data: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object, raising ImageError naming `what`."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ImageError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ImageError(f"{what} is not a JSON object")
    return doc


def descriptor(media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
    """A descriptor for in-memory content."""
    return {"mediaType": media_type, "digest": sha256_digest(data), "size": len(data), **extra}


def check_descriptor(desc: object, what: str) -> dict[str, Any]:
    """Validate the fields of a descriptor we use (mediaType, digest, size)."""
    if not isinstance(desc, dict):
        raise ImageError(f"{what}: descriptor is not a JSON object")
    check_digest_syntax(desc.get("digest"), what)
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ImageError(f"{what}: descriptor size {size!r} is not a non-negative integer")
    if not isinstance(desc.get("mediaType", ""), str):
        raise ImageError(f"{what}: descriptor mediaType is not a string")
    return desc


def media_type_of(doc: Mapping[str, Any], fallback: str = "") -> str:
    """A manifest/index document's type: its mediaType field, else guessed from its keys."""
    mt = doc.get("mediaType")
    if isinstance(mt, str) and mt:
        return mt
    if fallback in INDEX_TYPES or fallback in MANIFEST_TYPES:
        return fallback
    if "manifests" in doc:
        return OCI_INDEX
    if "layers" in doc:
        return OCI_MANIFEST
    return fallback


def platform_text(desc: Mapping[str, Any]) -> str:
    """"os/arch[/variant]" of an index entry, or "unknown platform"."""
    p = desc.get("platform")
    if not isinstance(p, dict):
        return "unknown platform"
    parts = [str(p.get("os", "?")), str(p.get("architecture", "?"))]
    if p.get("variant"):
        parts.append(str(p["variant"]))
    return "/".join(parts)


def is_attestation(desc: Mapping[str, Any]) -> bool:
    """An index entry that is a BuildKit attestation manifest (in-toto layers, not a filesystem)."""
    ann = desc.get("annotations") or {}
    p = desc.get("platform") or {}
    return (isinstance(ann, dict) and ann.get("vnd.docker.reference.type") == "attestation-manifest") or (
        isinstance(p, dict) and p.get("os") == "unknown" and p.get("architecture") == "unknown")
