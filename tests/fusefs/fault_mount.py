"""The mount process with two extra reader kinds, for fault tests (`python -m tests.fusefs.fault_mount STATE`):
"fail" raises FetchError on every read, "hang" never answers. Also shows how a reader kind plugs in."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from snapshotter.errors import FetchError
from snapshotter.formats.index import Entry, LayerIndex
from snapshotter.fusefs.ops import LayerReader
from snapshotter.fusefs.process import LayerSpec, ReaderEnv, main


class _Fail:
    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        await trio.lowlevel.checkpoint()
        raise FetchError(f"registry unreachable for {entry.name}")


class _Hang:
    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


@asynccontextmanager
async def failing(spec: LayerSpec, index: LayerIndex, env: ReaderEnv) -> AsyncIterator[LayerReader]:
    yield _Fail()


@asynccontextmanager
async def hanging(spec: LayerSpec, index: LayerIndex, env: ReaderEnv) -> AsyncIterator[LayerReader]:
    yield _Hang()


if __name__ == "__main__":
    sys.exit(main(reader_kinds={"fail": failing, "hang": hanging}))
