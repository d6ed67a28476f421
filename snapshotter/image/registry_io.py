"""Whole-blob pulls and pushes against a registry, for the `convert` tool.

Pull: `pull_blob` streams a blob into a writable file in bounded pieces (`RegistryClient.
read_range`, 8 MiB each, so retries and the client's in-flight byte budget apply per piece),
hashing as it goes; the result must match the descriptor's digest and size. `read_json_blob`
does the same for small blobs (configs) into memory, capped at MAX_JSON_BYTES.
Push: `snapshotter.fetch.push.RegistryPusher` (HEAD to skip existing blobs, POST + PUT
uploads, manifests by tag or digest), re-exported here.
Every failure is a FetchError / ImageError naming registry, repository and digest.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from typing import IO

from snapshotter.fetch.client import RegistryClient
from snapshotter.fetch.push import RegistryPusher
from snapshotter.fetch.reference import Reference
from snapshotter.image.model import MAX_JSON_BYTES, ImageError

PIECE = 8 << 20

__all__ = ["PIECE", "RegistryPusher", "pull_blob", "read_json_blob"]


async def pull_blob(client: RegistryClient, ref: Reference, digest: str, size: int, out: IO[bytes],
                    progress: Callable[[int], None] | None = None, *, piece: int = PIECE) -> None:
    """Write blob `digest` (`size` bytes, from the descriptor) of `ref`'s repository to `out`."""
    h = hashlib.sha256()
    done = 0
    while done < size:
        n = min(piece, size - done)
        data = await client.read_range(ref, digest, done, n)
        h.update(data)
        out.write(data)
        done += n
        if progress is not None:
            progress(n)
    got = "sha256:" + h.hexdigest()
    if got != digest:
        raise ImageError(f"registry {ref.registry}, repository {ref.repository}: blob {digest} "
                         f"({size} bytes per its descriptor) hashes to {got}")


async def read_json_blob(client: RegistryClient, ref: Reference, digest: str, size: int) -> bytes:
    if size > MAX_JSON_BYTES:
        raise ImageError(f"registry {ref.registry}, repository {ref.repository}: blob {digest} is "
                         f"{size} bytes, more than the {MAX_JSON_BYTES} allowed for a config")
    buf = io.BytesIO()
    await pull_blob(client, ref, digest, size, buf)
    return buf.getvalue()
