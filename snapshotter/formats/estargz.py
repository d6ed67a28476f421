"""eStargz and legacy stargz: footer, TOC reader and streaming writer (one import for callers).

Reading a layer: `parse_footer(blob[-51:])` -> `toc_range(footer, blob_size)` -> fetch that range ->
`parse_toc(member, blob_size=..., layer_digest=..., max_toc_bytes=..., toc_offset=footer.toc_offset)`
-> for each chunk fetch blob[chunk.blob_offset : +chunk.blob_size], `codec.decompress_chunk`, then
`verify_chunk(chunk, plain)`. Writing: `write_estargz(src_tar, dst)`.

Byte facts: /work/shared/FORMATS.md section 3; the modules below hold the details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from snapshotter.formats.digest import check_digest
from snapshotter.formats.estargz_footer import (
    FOOTER_SIZE,
    LEGACY_FOOTER_SIZE,
    Footer,
    footer_bytes,
    parse_footer,
    toc_range,
)
from snapshotter.formats.estargz_toc import FORMAT_NAME, TOC_TAR_NAME, parse_toc
from snapshotter.formats.index import Chunk

if TYPE_CHECKING:
    from snapshotter.formats.estargz_writer import (
        TOC_DIGEST_ANNOTATION,
        UNCOMPRESSED_SIZE_ANNOTATION,
        EstargzResult,
        write_estargz,
    )

# The writer's names, imported on first use: the daemon and the mount processes only read
# layers, and the writer (with tarfile) is 0.4 MiB of each one's memory.
_WRITER_NAMES = frozenset({"TOC_DIGEST_ANNOTATION", "UNCOMPRESSED_SIZE_ANNOTATION", "EstargzResult", "write_estargz"})


def __getattr__(name: str) -> Any:
    if name in _WRITER_NAMES:
        from snapshotter.formats import estargz_writer

        value = getattr(estargz_writer, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "FOOTER_SIZE", "LEGACY_FOOTER_SIZE", "FORMAT_NAME", "TOC_TAR_NAME", "TOC_DIGEST_ANNOTATION",
    "UNCOMPRESSED_SIZE_ANNOTATION", "EstargzResult", "Footer", "footer_bytes", "parse_footer",
    "parse_toc", "toc_range", "verify_chunk", "write_estargz",
]


def verify_chunk(chunk: Chunk, data: bytes) -> None:
    """Raise DigestMismatch unless `data` (the chunk's uncompressed file bytes) matches its digest.

    A chunk without a recorded digest passes (the caller may still check the whole file).
    """
    if chunk.digest is not None:
        check_digest(chunk.digest, data,
                     f"eStargz chunk at blob offset {chunk.blob_offset} (file offset {chunk.file_offset})")
