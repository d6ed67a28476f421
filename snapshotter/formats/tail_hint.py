"""The tail-size hint: a layer descriptor annotation our converter writes so that a snapshotter
fetches a layer's lazy-format metadata in one request. Pure: no IO.

A snapshotter that knows only the layer digest must first GET a fixed-size suffix of the blob to
read the footer, and only then can it GET the TOC the footer points at: two registry round trips
whenever the TOC is larger than that suffix (any layer with a few thousand files). The annotation
`containerd.io/snapshot/lazy/tail.size` = decimal bytes from the first byte of the TOC (eStargz:
its gzip member; zstd:chunked: the compressed manifest) to the end of the blob, so the first GET
can ask for all of it. Keys under `containerd.io/snapshot/` are copied by containerd's unpacker
into the Prepare labels, as the eStargz TOC digest is.

It is only a hint: the footer that arrives still decides where the TOC is, and a tail too short
for it costs the second request, no more.
"""

from __future__ import annotations

TAIL_SIZE_ANNOTATION = "containerd.io/snapshot/lazy/tail.size"


def tail_size_annotation(blob_size: int, metadata_offset: int) -> dict[str, str]:
    """The annotation for a blob of `blob_size` bytes whose TOC starts at `metadata_offset`."""
    if not 0 <= metadata_offset < blob_size:
        raise ValueError(f"metadata offset {metadata_offset} is outside a blob of {blob_size} bytes")
    return {TAIL_SIZE_ANNOTATION: str(blob_size - metadata_offset)}


def parse_tail_size(value: str | None) -> int | None:
    """The hinted tail size, or None when absent or not a positive decimal integer (a bad hint
    is ignored rather than refused: it can only make the fetch slower, never wrong)."""
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 18:
        return None
    size = int(value)
    return size if size > 0 else None
