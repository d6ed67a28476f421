"""Where compressed chunk bytes come from: the `RangeSource` protocol and two implementations.

`RangeSource.read_range(blob, offset, length)` returns exactly blob[offset:offset+length] of
the layer's blob number `blob` (an index into `LayerIndex.blobs`), or raises FetchError.
`StreamingRangeSource.stream_range(blob, offset, length, sink)` hands the same bytes to a
`RangeSink` in pieces as they arrive, so that the caller need not hold them all; both
implementations here are streaming sources.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import trio

from snapshotter.errors import FetchError


@runtime_checkable
class RangeSource(Protocol):
    async def read_range(self, blob: int, offset: int, length: int) -> bytes | bytearray:
        """Exactly `length` bytes of blob number `blob` from `offset` (FetchError otherwise)."""
        ...


class RangeSink(Protocol):
    """Receives a range's bytes in order, in pieces of any size."""

    async def restart(self) -> None:
        """The bytes start over from the range's first byte (a retried request): forget what
        `write` was given so far."""
        ...

    async def write(self, data: bytes | bytearray | memoryview) -> None: ...


@runtime_checkable
class StreamingRangeSource(RangeSource, Protocol):
    async def stream_range(self, blob: int, offset: int, length: int, sink: RangeSink) -> None:
        """Give exactly `length` bytes of blob number `blob` from `offset` to `sink.write`, in
        order (after a `sink.restart()`, from the first byte again), or raise FetchError."""
        ...


STREAM_PIECE = 256 << 10  # the pieces a file source reads


@runtime_checkable
class BatchRangeSource(RangeSource, Protocol):
    async def read_ranges(self, blob: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, length) in `ranges`, in order (may merge requests)."""
        ...


class FileRangeSource:
    """Blobs stored as local files (tests, `convert`, local layouts)."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        self.paths = [os.fspath(p) for p in paths]

    def _pread(self, blob: int, offset: int, length: int) -> bytes:
        try:
            path = self.paths[blob]
        except IndexError:
            raise FetchError(f"no blob number {blob} (have {len(self.paths)})") from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.pread(fd, length, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise FetchError(f"{path}: cannot read {length} bytes at {offset}: {exc}") from exc
        if len(data) != length:
            raise FetchError(f"{path}: short read, {len(data)} of {length} bytes at {offset}")
        return data

    async def read_range(self, blob: int, offset: int, length: int) -> bytes:
        return await trio.to_thread.run_sync(self._pread, blob, offset, length)

    async def read_ranges(self, blob: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [await self.read_range(blob, off, n) for off, n in ranges]

    async def stream_range(self, blob: int, offset: int, length: int, sink: RangeSink) -> None:
        pos = offset
        while pos < offset + length:
            n = min(STREAM_PIECE, offset + length - pos)
            await sink.write(await trio.to_thread.run_sync(self._pread, blob, pos, n))
            pos += n


class RegistryRangeSource:
    """Adapts the registry client (`read_range(repo, digest, offset, length)`, optionally
    `read_ranges(repo, digest, ranges)`) to a RangeSource for one layer's blobs."""

    def __init__(self, client: Any, repo: str, blobs: Sequence[str]) -> None:
        self.client = client
        self.repo = repo
        self.blobs = tuple(blobs)

    def _digest(self, blob: int) -> str:
        try:
            return self.blobs[blob]
        except IndexError:
            raise FetchError(f"{self.repo}: no blob number {blob} (have {len(self.blobs)})") from None

    async def read_range(self, blob: int, offset: int, length: int) -> bytes | bytearray:
        return await self.client.read_range(self.repo, self._digest(blob), offset, length)

    async def stream_range(self, blob: int, offset: int, length: int, sink: RangeSink) -> None:
        streamed = getattr(self.client, "stream_range", None)
        if streamed is None:  # a client that only reads whole ranges
            await sink.write(await self.read_range(blob, offset, length))
            return
        await streamed(self.repo, self._digest(blob), offset, length, sink)

    async def read_ranges(self, blob: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        digest = self._digest(blob)
        batched = getattr(self.client, "read_ranges", None)
        if batched is None:
            return [bytes(await self.read_range(blob, off, n)) for off, n in ranges]
        return [bytes(d) for d in await batched(self.repo, digest, list(ranges))]
