"""What containerd clients tell a remote snapshotter about a layer, read from snapshot labels.

Two clients send them (both accepted, CRI first):
- containerd's CRI plugin (`disable_snapshot_annotations = false`, pkg/snapshotters/annotations.go):
  containerd.io/snapshot/cri.{image-ref, layer-digest, image-layers, manifest-digest}
- `ctr-remote image rpull` (stargz-snapshotter fs/source/source.go):
  containerd.io/snapshot/remote/stargz.{reference, digest, layers}
Every client's unpacker adds `containerd.io/snapshot.ref` (the chain id the snapshot will be
committed as) and copies the layer descriptor's `containerd.io/snapshot/*` annotations, such as
the eStargz TOC digest, the Nydus blob/bootstrap markers and our converter's tail-size hint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from snapshotter.errors import InvalidArgument
from snapshotter.formats.tail_hint import TAIL_SIZE_ANNOTATION, parse_tail_size

TARGET_SNAPSHOT_REF = "containerd.io/snapshot.ref"
REMOTE_LABEL = "containerd.io/snapshot/remote"

CRI_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
CRI_LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
CRI_IMAGE_LAYERS = "containerd.io/snapshot/cri.image-layers"
CRI_MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"

STARGZ_REFERENCE = "containerd.io/snapshot/remote/stargz.reference"
STARGZ_DIGEST = "containerd.io/snapshot/remote/stargz.digest"
STARGZ_LAYERS = "containerd.io/snapshot/remote/stargz.layers"

TOC_DIGEST = "containerd.io/snapshot/stargz/toc.digest"
UNCOMPRESSED_SIZE = "io.containers.estargz.uncompressed-size"
NYDUS_BLOB = "containerd.io/snapshot/nydus-blob"
NYDUS_BOOTSTRAP = "containerd.io/snapshot/nydus-bootstrap"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class LayerRef:
    """One layer of one image, as a remote snapshotter must find it."""

    image_ref: str
    layer_digest: str
    image_layers: tuple[str, ...]
    manifest_digest: str | None
    toc_digest: str | None
    nydus_blob: bool
    nydus_bootstrap: bool
    client: str  # "cri" or "stargz"
    tail_size: int | None = None  # the tail-size hint (formats/tail_hint.py), when the layer has one


def _digest(value: str, label: str) -> str:
    if not _DIGEST.match(value):
        raise InvalidArgument(f"label {label}={value!r} is not a sha256 digest")
    return value


def claimed_layer(labels: Mapping[str, str]) -> tuple[str, str]:
    """(image reference, layer digest) as the labels state them, unvalidated ("" when absent):
    for log lines about a layer whose labels may be the very thing that is wrong."""
    image = labels.get(CRI_IMAGE_REF) or labels.get(STARGZ_REFERENCE, "")
    layer = labels.get(CRI_LAYER_DIGEST) or labels.get(STARGZ_DIGEST, "")
    return image, layer


def layer_ref_from_labels(labels: Mapping[str, str]) -> LayerRef | None:
    """The layer the labels describe, or None when they carry no remote-snapshot information.

    Raises InvalidArgument naming the label when a present label is malformed.
    """
    if CRI_IMAGE_REF in labels and CRI_LAYER_DIGEST in labels:
        ref_label, digest_label, layers_label, client = CRI_IMAGE_REF, CRI_LAYER_DIGEST, CRI_IMAGE_LAYERS, "cri"
    elif STARGZ_REFERENCE in labels and STARGZ_DIGEST in labels:
        ref_label, digest_label, layers_label, client = STARGZ_REFERENCE, STARGZ_DIGEST, STARGZ_LAYERS, "stargz"
    else:
        return None
    image_ref = labels[ref_label].strip()
    if not image_ref or any(c.isspace() for c in image_ref):
        raise InvalidArgument(f"label {ref_label}={labels[ref_label]!r} is not an image reference")
    layer_digest = _digest(labels[digest_label], digest_label)
    layers = tuple(_digest(d, layers_label) for d in labels.get(layers_label, "").split(",") if d)
    manifest = labels.get(CRI_MANIFEST_DIGEST)
    toc = labels.get(TOC_DIGEST)
    return LayerRef(
        image_ref=image_ref,
        layer_digest=layer_digest,
        image_layers=layers,
        manifest_digest=_digest(manifest, CRI_MANIFEST_DIGEST) if manifest else None,
        toc_digest=_digest(toc, TOC_DIGEST) if toc else None,
        nydus_blob=labels.get(NYDUS_BLOB) == "true",
        nydus_bootstrap=labels.get(NYDUS_BOOTSTRAP) == "true",
        client=client,
        tail_size=parse_tail_size(labels.get(TAIL_SIZE_ANNOTATION)),
    )
