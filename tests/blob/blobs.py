"""Build eStargz-like test blobs: each chunk of each file is its own gzip member.

Some chunks carry a prefix inside their member (like the tar header or a packed neighbour in
eStargz), so their `inner_offset` is non-zero. Digests are sha256 of the chunk's bytes unless
`digests=False` (formats that record none).
"""

from __future__ import annotations

import gzip
import random
from dataclasses import dataclass
from pathlib import Path

from snapshotter.formats.digest import compute_digest
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType


@dataclass
class BuiltBlob:
    path: Path
    entries: dict[str, Entry]
    contents: dict[str, bytes]


def file_bytes(rng: random.Random, size: int) -> bytes:
    """Semi-compressible content: random words from a small vocabulary plus random bytes."""
    words = [rng.randbytes(rng.randint(1, 12)) for _ in range(64)]
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words) if rng.random() < 0.8 else rng.randbytes(rng.randint(1, 64))
    return bytes(out[:size])


def build_blob(
    path: Path,
    files: dict[str, bytes],
    *,
    chunk_size: int,
    seed: int = 0,
    digests: bool = True,
    lead: bytes = b"",
    algo: str = "sha256",
) -> BuiltBlob:
    """Write a blob holding `files` (name -> content) chunked by `chunk_size`; `lead` goes first."""
    rng = random.Random(seed)
    blob = bytearray(gzip.compress(lead, compresslevel=1, mtime=0) if lead else b"")
    entries: dict[str, Entry] = {}
    for name, content in files.items():
        chunks = []
        for off in range(0, len(content), chunk_size):
            piece = content[off:off + chunk_size]
            prefix = rng.randbytes(rng.choice([0, 0, 17, 512]))
            member = gzip.compress(prefix + piece, compresslevel=rng.choice([1, 6]), mtime=0)
            chunks.append(
                Chunk(
                    file_offset=off,
                    size=len(piece),
                    blob_offset=len(blob),
                    blob_size=len(member),
                    compression=Compression.GZIP,
                    digest=compute_digest(algo, piece) if digests else None,
                    inner_offset=len(prefix),
                )
            )
            blob += member
        entries[name] = Entry(name=name, type=EntryType.REG, size=len(content), chunks=tuple(chunks))
    blob += gzip.compress(b"trailer", mtime=0)
    path.write_bytes(bytes(blob))
    return BuiltBlob(path=path, entries=entries, contents=dict(files))
