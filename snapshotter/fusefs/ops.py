"""pyfuse3 Operations over a MountTree: translate FUSE requests to tree lookups and layer reads.

Contracts:
- Read-only: every modifying request answers EROFS (the mount is also `ro`, so the kernel
  rejects most of them before they arrive).
- The tree never changes, so the kernel may cache everything: entries (negative ones too) and
  attributes get `cache_timeout`, opened files `keep_cache`, and `forget` only keeps the lookup
  counts honest (nothing is freed; `lookup_counts` is for tests and debugging).
- Errors leave as FUSEError(errno) and nothing else (an exception of any other kind would leave
  the kernel request unanswered): a reader raising one of our errors (FetchError,
  DigestMismatch, any SnapshotterError) or OSError gives EIO, so does a read that takes longer
  than `fetch_timeout` (the reader is cancelled), and so does an unexpected exception (logged
  with its traceback). A read overlapping one of the same file that failed slowly (at least
  fetch_timeout/2) less than RECENT_FAILURE_SECONDS ago fails at once: the kernel retries a
  failed readahead as a one-page read, which would double the caller's wait.
- A read returns exactly min(size, file size - offset) bytes, or fails; a reader returning
  another length is a bug reported as EIO, never a silent short read.
- Readdir offsets are positions in the directory's sorted name list, so they stay valid
  across calls. "." and ".." are left to the kernel.
- First-read order: the first `read` of each inode appends its node to `recorder` before the
  bytes are fetched (the order in which the workload asked, not in which fetches finished).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import pyfuse3
import trio

from snapshotter.errors import SnapshotterError
from snapshotter.formats.codec import Buffer
from snapshotter.formats.index import Entry, EntryType
from snapshotter.fusefs.tree import MountTree, Node

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# A read overlapping one that failed slowly (timed out) this recently fails at once (see
# LazyOperations.read): long enough for the kernel's immediate retry, short enough that a
# caller's own retry reaches the registry again.
RECENT_FAILURE_SECONDS = 0.25


class LayerReader(Protocol):
    """Reads file bytes of one layer. One reader per layer of the MountTree (same order).

    read: the bytes [offset, offset+size) of a regular-file entry of that layer's index, clipped
    to the file's size. Raises FetchError / DigestMismatch / other SnapshotterErrors on failure;
    must tolerate cancellation at any await.
    """

    async def read(self, entry: Entry, offset: int, size: int) -> Buffer: ...


@dataclass(frozen=True)
class FsConfig:
    """fetch_timeout: bound on one read (seconds); cache_timeout: kernel entry/attr cache (seconds)."""

    fetch_timeout: float = 30.0
    cache_timeout: float = 24 * 3600.0
    block_size: int = 4096
    name_max: int = 255

    def __post_init__(self) -> None:
        if self.fetch_timeout <= 0 or self.cache_timeout < 0 or self.block_size <= 0:
            raise ValueError(f"bad filesystem config {self}")


# Upper bounds (seconds) of the FUSE latency histogram buckets; a last, implicit bucket is +Inf.
LATENCY_BUCKETS: tuple[float, ...] = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass
class OpStatistics:
    """One FUSE operation: calls, calls answered with an error, latency (sum and per-bucket
    counts, NOT cumulative; `buckets[-1]` counts calls slower than every bound)."""

    count: int = 0
    errors: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, seconds: float, error: bool) -> None:
        self.count += 1
        self.errors += error
        self.seconds += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1
                return
        self.buckets[-1] += 1


@dataclass
class FsStatistics:
    """Counters since the Operations were made (a live object). `ops` is keyed by operation
    name (lookup, getattr, read, ...): every request that goes through `_edge`."""

    reads: int = 0
    read_bytes: int = 0
    read_errors: int = 0
    read_timeouts: int = 0
    unexpected_errors: int = 0
    ops: dict[str, OpStatistics] = field(default_factory=dict)
    # Distinct chunks that reads touched, and their compressed bytes: what a perfect fetcher
    # would have had to download for these reads (the benchmark's "actually read").
    demand_chunks: int = 0
    demand_chunk_bytes: int = 0
    _demanded: set[tuple[int, int, int]] = field(default_factory=set, repr=False)

    def note_demand(self, layer: int, entry: Entry, offset: int, size: int) -> None:
        for c in entry.chunks_for(offset, size):
            key = (layer, c.blob_index, c.blob_offset)
            if c.zeros or key in self._demanded:
                continue
            self._demanded.add(key)
            self.demand_chunks += 1
            self.demand_chunk_bytes += c.blob_size

    def observe(self, op: str, seconds: float, error: bool) -> None:
        stat = self.ops.get(op)
        if stat is None:
            stat = self.ops[op] = OpStatistics()
        stat.observe(seconds, error)


class ReadRecorder:
    """Files of `tree` in the order of their first read."""

    def __init__(self, tree: MountTree) -> None:
        self._tree = tree
        self._seen: set[int] = set()
        self._nodes: list[Node] = []

    def note(self, node: Node) -> None:
        if node.inode not in self._seen:
            self._seen.add(node.inode)
            self._nodes.append(node)

    @property
    def paths(self) -> list[str]:
        """Mount-relative paths ("0/usr/bin/env" with subtrees), first read first."""
        return [self._tree.path_of(n) for n in self._nodes]

    def records(self) -> list[dict[str, Any]]:
        """One dict per file: path, layer (position in MountTree.layers), name (the entry's name in that layer)."""
        return [
            {"path": self._tree.path_of(n), "layer": n.layer, "name": n.entry.name if n.entry is not None else None}
            for n in self._nodes
        ]

    def dump(self) -> bytes:
        """JSON: {"files": [records...]}."""
        return json.dumps({"files": self.records()}, ensure_ascii=True).encode("ascii")


def _edge(
    fn: Callable[Concatenate[LazyOperations, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[LazyOperations, P], Coroutine[Any, Any, T]]:
    """Turn every exception but FUSEError (and cancellation) into EIO, logging it; count the
    request in `stats` and tell `on_request` (the background fetch's gate) that one ended."""

    @functools.wraps(fn)
    async def wrapper(self: LazyOperations, *args: P.args, **kwargs: P.kwargs) -> T:
        start = time.monotonic()
        error = True
        try:
            result = await fn(self, *args, **kwargs)
            error = False
            return result
        except pyfuse3.FUSEError:
            raise
        except Exception:
            self.stats.unexpected_errors += 1
            log.exception("fuse %s%r failed unexpectedly", fn.__name__, args)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self.stats.observe(fn.__name__, time.monotonic() - start, error)
            if self.on_request is not None:
                self.on_request()

    return wrapper


def _erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class LazyOperations(pyfuse3.Operations):
    """The Operations of one mount. `readers[i]` serves `tree.layers[i]`."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        tree: MountTree,
        readers: Sequence[LayerReader],
        config: FsConfig | None = None,
        recorder: ReadRecorder | None = None,
        on_request: Callable[[], None] | None = None,
        on_file_end: Callable[[Node], None] | None = None,
    ) -> None:
        """on_request: called after each request (any operation), on the event loop.
        on_file_end: called with the node after a read that reached its last byte (fusefs/direct.py)."""
        super().__init__()
        if len(readers) != len(tree.layers):
            raise ValueError(f"{len(readers)} readers for {len(tree.layers)} layers")
        self.tree = tree
        self.readers = tuple(readers)
        self.config = config or FsConfig()
        self.recorder = recorder if recorder is not None else ReadRecorder(tree)
        self.stats = FsStatistics()
        self.on_request = on_request
        self.on_file_end = on_file_end
        self.lookup_counts: dict[int, int] = {}
        # inode -> (when, offset, end) of its last failed read; see `read`.
        self._failed: dict[int, tuple[float, int, int]] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _node(self, inode: int) -> Node:
        node = self.tree.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = self.config.cache_timeout
        a.attr_timeout = self.config.cache_timeout
        a.st_mode = node.st_mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = node.rdev
        a.st_size = node.size
        a.st_blksize = self.config.block_size
        a.st_blocks = (node.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        return a

    def _counted(self, node: Node) -> pyfuse3.EntryAttributes:
        self.lookup_counts[node.inode] = self.lookup_counts.get(node.inode, 0) + 1
        return self.attributes(node)

    # -- lookups and attributes ------------------------------------------------------------

    @_edge
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._node(parent_inode)
        if not parent.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name == b".":
            return self._counted(parent)
        if name == b"..":
            return self._counted(self.tree[parent.parent])
        node = self.tree.lookup(parent_inode, os.fsdecode(name))
        if node is None:
            # A negative entry the kernel may cache as long as a positive one: nothing changes.
            neg = pyfuse3.EntryAttributes()
            neg.st_ino = 0
            neg.entry_timeout = self.config.cache_timeout
            return neg
        return self._counted(node)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for inode, n in inode_list:
            left = self.lookup_counts.get(inode, 0) - n
            if left > 0:
                self.lookup_counts[inode] = left
            else:
                self.lookup_counts.pop(inode, None)

    @_edge
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attributes(self._node(inode))

    @_edge
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        if node.type is not EntryType.SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.link_target)

    @_edge
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        self._node(inode)
        return not mode & os.W_OK

    # -- directories -----------------------------------------------------------------------

    @_edge
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        if not self._node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return pyfuse3.FileHandleT(inode)

    @_edge
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self._node(fh)
        for pos in range(start_id, len(node.names)):
            name = node.names[pos]
            child = self.tree[node.children[name]]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self.attributes(child), pos + 1):
                break
            # readdir_reply accepted it: the kernel now holds a lookup reference.
            self.lookup_counts[child.inode] = self.lookup_counts.get(child.inode, 0) + 1

    async def releasedir(self, fh: int) -> None:
        return None

    # -- files -----------------------------------------------------------------------------

    @_edge
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise _erofs()
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    # pyfuse3 types read() as returning bytes, but it sends any contiguous buffer (it takes the
    # result with PyObject_GetBuffer); a bytearray, or a memoryview of a pooled buffer, saves
    # copying each read once more.
    @_edge
    async def read(self, fh: int, off: int, size: int) -> Buffer:  # type: ignore[override]
        node = self._node(fh)
        if node.type is not EntryType.REG or node.entry is None or node.layer is None:
            raise pyfuse3.FUSEError(errno.EINVAL)
        want = max(0, min(size, node.size - off))
        if want == 0 or off < 0:
            return b""
        self.recorder.note(node)
        self.stats.reads += 1
        started = time.monotonic()
        failed = self._failed.get(fh)
        if failed is not None and started - failed[0] < RECENT_FAILURE_SECONDS \
                and off < failed[2] and failed[1] < off + want:
            # The kernel retries a failed readahead at once as a one-page read: answering it
            # from the slow failure just seen keeps the caller's wait at one fetch_timeout, not two.
            self.stats.read_errors += 1
            raise pyfuse3.FUSEError(errno.EIO)
        reader = self.readers[node.layer]
        data: Buffer | None = None
        with trio.move_on_after(self.config.fetch_timeout):
            try:
                data = await reader.read(node.entry, off, want)
            except (SnapshotterError, OSError) as exc:
                self.stats.read_errors += 1
                if time.monotonic() - started >= self.config.fetch_timeout / 2:
                    self._failed[fh] = (time.monotonic(), off, off + want)
                log.warning("read of %r [%d, +%d) failed: %s: %s", self.tree.path_of(node), off, want,
                            type(exc).__name__, exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
        if data is None:
            self.stats.read_timeouts += 1
            self._failed[fh] = (time.monotonic(), off, off + want)
            log.warning("read of %r [%d, +%d) took over %.1fs; answering EIO",
                        self.tree.path_of(node), off, want, self.config.fetch_timeout)
            raise pyfuse3.FUSEError(errno.EIO)
        self._failed.pop(fh, None)
        if len(data) != want:
            self.stats.read_errors += 1
            log.error("reader returned %d bytes for %r [%d, +%d)", len(data), self.tree.path_of(node), off, want)
            raise pyfuse3.FUSEError(errno.EIO)
        self.stats.read_bytes += want
        self.stats.note_demand(node.layer, node.entry, off, want)
        if off + want == node.size and self.on_file_end is not None:
            self.on_file_end(node)
        return data  # pyfuse3 sends any buffer: a buffer read from the page cache is not copied again

    async def release(self, fh: int) -> None:
        return None

    async def flush(self, fh: int) -> None:
        return None

    # -- xattrs and statfs -----------------------------------------------------------------

    @_edge
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if not self.tree.has_xattrs:
            # ENOSYS makes the kernel answer every later getxattr with EOPNOTSUPP itself. overlayfs
            # asks for its trusted.overlay.* names on every lookup through it: a request per file
            # (half the requests of a `find` in a container) for an image with no xattrs at all.
            raise pyfuse3.FUSEError(errno.ENOSYS)
        value = self._node(inode).xattrs.get(os.fsdecode(name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return bytes(value)

    @_edge
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return [os.fsencode(k) for k in self._node(inode).xattrs]

    @_edge
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        bs = self.config.block_size
        s.f_bsize = bs
        s.f_frsize = bs
        s.f_blocks = (self.tree.file_bytes + bs - 1) // bs
        s.f_bfree = 0
        s.f_bavail = 0
        s.f_files = len(self.tree)
        s.f_ffree = 0
        s.f_favail = 0
        s.f_namemax = self.config.name_max
        return s

    # -- everything that would modify: EROFS -----------------------------------------------

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        raise _erofs()

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        raise _erofs()

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _erofs()

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _erofs()

    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        raise _erofs()

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _erofs()

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise _erofs()

    async def fsync(self, fh: int, datasync: bool) -> None:
        return None

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None
