"""LazyOperations called directly (no kernel): attributes, reads through readers, error mapping."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Awaitable, Callable
from types import MappingProxyType
from typing import Any

import pyfuse3
import pytest
import trio

from snapshotter.errors import CacheError, DigestMismatch, FetchError
from snapshotter.formats.index import Entry, EntryType
from snapshotter.fusefs.ops import FsConfig, LazyOperations
from snapshotter.fusefs.tree import ROOT_INODE, build_tree
from tests.fusefs.layers import T0, Layer

CONTENT = bytes(range(256)) * 40  # 10240 bytes


class FakeReader:
    """Serves CONTENT-like bytes from a dict, or misbehaves as told."""

    def __init__(self, contents: dict[str, bytes], behaviour: str = "ok") -> None:
        self.contents = contents
        self.behaviour = behaviour
        self.calls: list[tuple[str, int, int]] = []

    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        self.calls.append((entry.name, offset, size))
        await trio.lowlevel.checkpoint()
        if self.behaviour == "fetch":
            raise FetchError("registry said 503")
        if self.behaviour == "digest":
            raise DigestMismatch("bad chunk")
        if self.behaviour == "cache":
            raise CacheError("disk full")
        if self.behaviour == "bug":
            raise KeyError("oops")
        if self.behaviour == "hang":
            await trio.sleep_forever()
        if self.behaviour == "short":
            return self.contents[entry.name][offset:offset + size - 1]
        return self.contents[entry.name][offset:offset + size]


def make_ops(behaviour: str = "ok", fetch_timeout: float = 5.0) -> tuple[LazyOperations, FakeReader]:
    l0 = (Layer().dir("", mode=0o755).file("big", CONTENT, uid=7, gid=8)
          .hardlink("big-link", "big").symlink("sym", "big")
          .file("x", b"", xattrs=MappingProxyType({"user.a": b"\x00b"})).device("null", EntryType.CHAR, 1, 3))
    l1 = Layer().file("small", b"hello")
    tree = build_tree([[l0.index(), l1.index()]], subtrees=False)
    reader = FakeReader({"big": CONTENT, "small": b"hello", "x": b""}, behaviour)
    return LazyOperations(tree, [reader, reader], FsConfig(fetch_timeout=fetch_timeout, cache_timeout=600)), reader


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return trio.run(fn)


def fuse_errno(fn: Callable[[], Awaitable[Any]]) -> int:
    with pytest.raises(pyfuse3.FUSEError) as info:
        run(fn)
    return info.value.errno


CTX: Any = None


def test_lookup_getattr_and_negative_entries() -> None:
    ops, _ = make_ops()

    async def go() -> None:
        big = await ops.lookup(ROOT_INODE, b"big", CTX)
        link = await ops.lookup(ROOT_INODE, b"big-link", CTX)
        assert big.st_ino == link.st_ino and big.st_nlink == 2
        assert stat.S_ISREG(big.st_mode) and big.st_size == len(CONTENT) and (big.st_uid, big.st_gid) == (7, 8)
        assert big.st_mtime_ns == T0 and big.st_blocks == (len(CONTENT) + 511) // 512
        assert big.entry_timeout == 600 and big.attr_timeout == 600
        assert ops.lookup_counts[big.st_ino] == 2
        again = await ops.getattr(big.st_ino, CTX)
        assert again.st_size == big.st_size
        null = await ops.lookup(ROOT_INODE, b"null", CTX)
        assert null.st_rdev == os.makedev(1, 3)
        neg = await ops.lookup(ROOT_INODE, b"missing", CTX)
        assert neg.st_ino == 0 and neg.entry_timeout == 600
        dot = await ops.lookup(ROOT_INODE, b"..", CTX)
        assert dot.st_ino == ROOT_INODE
        assert await ops.readlink((await ops.lookup(ROOT_INODE, b"sym", CTX)).st_ino, CTX) == b"big"
        await ops.forget([(big.st_ino, 2)])
        assert big.st_ino not in ops.lookup_counts

    run(go)
    assert fuse_errno(lambda: ops.getattr(99999, CTX)) == errno.ENOENT
    assert fuse_errno(lambda: ops.readlink(ROOT_INODE, CTX)) == errno.EINVAL
    assert fuse_errno(lambda: ops.opendir(ops.tree.resolve("big").inode, CTX)) == errno.ENOTDIR  # type: ignore[union-attr]


def test_every_request_is_reported_to_on_request_failed_ones_too() -> None:
    """The background fetch's gate hears of each request (a lookup-heavy `find` pauses it too)."""
    ops, _ = make_ops()
    ended: list[str] = []
    ops.on_request = lambda: ended.append("request")

    async def go() -> None:
        node = await ops.lookup(ROOT_INODE, b"big", CTX)
        await ops.getattr(node.st_ino, CTX)
        with pytest.raises(pyfuse3.FUSEError):
            await ops.getattr(99999, CTX)
        assert len(ended) == 3 and ops.stats.ops["getattr"].count == 2

    run(go)


def test_reads_go_to_the_serving_layer_and_are_recorded_in_first_read_order() -> None:
    ops, reader = make_ops()
    big = ops.tree.resolve("big")
    small = ops.tree.resolve("small")
    assert big is not None and small is not None and small.layer == 1

    async def go() -> None:
        fi = await ops.open(small.inode, os.O_RDONLY, CTX)
        assert fi.fh == small.inode and fi.keep_cache
        assert await ops.read(small.inode, 0, 4096) == b"hello"
        assert await ops.read(big.inode, 10000, 4096) == CONTENT[10000:]
        assert await ops.read(big.inode, 100, 50) == CONTENT[100:150]
        assert await ops.read(big.inode, len(CONTENT), 10) == b""
        assert await ops.read(small.inode, 1, 2) == b"el"

    run(go)
    assert reader.calls == [("small", 0, 5), ("big", 10000, 240), ("big", 100, 50), ("small", 1, 2)]
    assert ops.recorder.paths == ["small", "big"]
    assert ops.recorder.records() == [{"path": "small", "layer": 1, "name": "small"},
                                      {"path": "big", "layer": 0, "name": "big"}]
    assert ops.stats.reads == 4 and ops.stats.read_bytes == 5 + 240 + 50 + 2


@pytest.mark.parametrize("behaviour", ["fetch", "digest", "cache", "bug", "short"])
def test_reader_failures_are_eio(behaviour: str) -> None:
    ops, _ = make_ops(behaviour)
    inode = ops.tree.resolve("big").inode  # type: ignore[union-attr]
    assert fuse_errno(lambda: ops.read(inode, 0, 100)) == errno.EIO
    # The failure is per read: the next one asks the reader again.
    assert fuse_errno(lambda: ops.read(inode, 0, 100)) == errno.EIO


def test_hanging_reader_times_out_with_eio() -> None:
    ops, _ = make_ops("hang", fetch_timeout=0.3)
    inode = ops.tree.resolve("big").inode  # type: ignore[union-attr]
    start = time.monotonic()
    assert fuse_errno(lambda: ops.read(inode, 0, 100)) == errno.EIO
    assert 0.25 < time.monotonic() - start < 3
    assert ops.stats.read_timeouts == 1


def test_everything_that_writes_is_erofs() -> None:
    ops, _ = make_ops()
    big = ops.tree.resolve("big").inode  # type: ignore[union-attr]
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: ops.open(big, os.O_WRONLY, CTX), lambda: ops.open(big, os.O_RDWR, CTX),
        lambda: ops.open(big, os.O_RDONLY | os.O_TRUNC, CTX),
        lambda: ops.write(big, 0, b"x"), lambda: ops.mkdir(ROOT_INODE, b"d", 0o755, CTX),
        lambda: ops.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY, CTX), lambda: ops.unlink(ROOT_INODE, b"big", CTX),
        lambda: ops.rmdir(ROOT_INODE, b"x", CTX), lambda: ops.symlink(ROOT_INODE, b"s", b"t", CTX),
        lambda: ops.rename(ROOT_INODE, b"big", ROOT_INODE, b"b2", 0, CTX), lambda: ops.link(big, ROOT_INODE, b"l", CTX),
        lambda: ops.setxattr(big, b"user.x", b"1", CTX), lambda: ops.removexattr(big, b"user.x", CTX),
        lambda: ops.mknod(ROOT_INODE, b"n", stat.S_IFIFO | 0o644, 0, CTX),
        lambda: ops.setattr(big, pyfuse3.EntryAttributes(), None, None, CTX),  # type: ignore[arg-type]
    ]
    for call in calls:
        assert fuse_errno(call) == errno.EROFS


def test_xattrs_and_statfs() -> None:
    ops, _ = make_ops()
    x = ops.tree.resolve("x").inode  # type: ignore[union-attr]

    async def go() -> None:
        assert await ops.getxattr(x, b"user.a", CTX) == b"\x00b"
        assert list(await ops.listxattr(x, CTX)) == [b"user.a"]
        assert list(await ops.listxattr(ROOT_INODE, CTX)) == []
        s = await ops.statfs(CTX)
        assert s.f_bsize == s.f_frsize == 4096
        assert s.f_blocks == (len(CONTENT) + 5 + 4095) // 4096
        assert s.f_files == len(ops.tree) == 6  # root, big(=big-link), sym, x, null, small
        assert s.f_bfree == s.f_bavail == s.f_ffree == 0 and s.f_namemax == 255

    run(go)
    assert fuse_errno(lambda: ops.getxattr(x, b"user.missing", CTX)) == pyfuse3.ENOATTR
