"""Direct reads: big files, once wholly cached, read by overlayfs from disk instead of through FUSE.

With a metadata image (fusefs/metaimage.py), a container's overlay finds a regular file's bytes
by the file's redirect ("/0/usr/lib/x.so", its path in the FUSE mount) in the data-only layers
listed after "::", the first layer that has it winning. The daemon lists this mount's direct
directory before the FUSE mount (`lowerdir=meta/1:meta/0::DIRECT::FUSE`, remote/backend.py).
Once every chunk of a regular file of at least `min_bytes` is in the chunk cache, this process
stores the file whole as one more cache entry (reader/keys.py `whole_file_key`), pins it (so
eviction and garbage collection keep it while this process lives) and hard-links it into DIRECT
under its redirect path. An overlay that looks the file's data up after that (overlayfs does so
when the file is first opened through it: a container started later) reads it from the cache's
own disk file, as it reads an ordinary layer's: no FUSE request, no copy through this process.
Overlays that opened the file before keep reading it through FUSE; both give the same bytes.

Contract:
- DIRECT holds nothing but hard links of committed whole-file entries and the directories
  above them, each link renamed into place (a lookup sees the whole file or none).
- Only this process writes DIRECT; it empties it when it starts (links a dead predecessor
  left) and then links the whole files already cached (an earlier mount's).
- Best effort: a file that cannot be stored or linked is logged and stays served by FUSE.
- A file is stored once its last byte has been read through the mount (`note_end`) and all its
  chunks are cached; its chunks stay cached as before (the cache evicts them as it would).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from snapshotter.cache import ChunkCache
from snapshotter.errors import CacheError, FormatError
from snapshotter.formats.index import EntryType
from snapshotter.fusefs.tree import MountTree, Node
from snapshotter.reader import LayerReader
from snapshotter.reader.keys import whole_file_key

log = logging.getLogger(__name__)

_ZEROS = bytes(1 << 20)


class DirectFiles:
    """The direct directory of one mount (see the module docstring).

    readers: one per layer of `tree`; layers whose reader is not a LayerReader of `cache` (a
    local blob's) are left to FUSE. `run` does the work (in the mount process's nursery); `note_end` is called on
    the event loop by the FUSE read that reached a file's last byte."""

    def __init__(self, tree: MountTree, readers: Sequence[object], cache: ChunkCache,
                 directory: Path, min_bytes: int) -> None:
        if min_bytes <= 0:
            raise ValueError("direct reads need a positive min_bytes")
        self.tree = tree
        self.readers = tuple(readers)
        self.cache = cache
        self.directory = directory
        self.min_bytes = min_bytes
        self.linked: dict[int, int] = {}  # inode -> bytes, of the files linked into the directory
        self.failed = 0
        self.started = trio.Event()  # set once `run` emptied the directory and linked what was cached
        self._queued: set[int] = set()
        self._send, self._receive = trio.open_memory_channel[Node](math.inf)

    # -- which files ---------------------------------------------------------------------------

    def _reader(self, node: Node) -> LayerReader | None:
        if node.layer is None:
            return None
        reader = self.readers[node.layer]
        return reader if isinstance(reader, LayerReader) and reader.cache is self.cache else None

    def wants(self, node: Node) -> bool:
        """Whether `node` is a file direct reads are for: regular, at least min_bytes, of
        several chunks (a one-chunk file is one cache file already, read through FUSE)."""
        return (node.type is EntryType.REG and node.size >= self.min_bytes and node.entry is not None
                and len(node.entry.chunks) > 1 and self._reader(node) is not None)

    def key(self, node: Node) -> str | None:
        reader = self._reader(node)
        if reader is None or node.entry is None:
            return None
        try:
            return whole_file_key(node.entry, reader.blobs)
        except (FormatError, ValueError):
            return None

    def note_end(self, node: Node) -> None:
        """A read reached the end of `node`: store and link it soon, if it is one of ours."""
        if node.inode in self.linked or node.inode in self._queued or not self.wants(node):
            return
        self._queued.add(node.inode)
        self._send.send_nowait(node)

    def stats(self) -> dict[str, Any]:
        """For the mount's stats file (fusefs/stats.py `stats_hooks`)."""
        return {"direct": {"files": len(self.linked), "bytes": sum(self.linked.values()), "failed": self.failed}}

    # -- the work ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Empty the directory, link the whole files already cached, then store and link each
        file `note_end` queues, one at a time, in a worker thread. Runs until cancelled."""
        await trio.to_thread.run_sync(self._start_sync)
        self.started.set()
        async for node in self._receive:
            try:
                await trio.to_thread.run_sync(self._store_sync, node)
            finally:
                self._queued.discard(node.inode)

    def _start_sync(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for child in self.directory.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        keys = {}
        for node in self.tree.nodes.values():
            if self.wants(node):
                key = self.key(node)
                if key is not None:
                    keys[node.inode] = key
        if not keys:
            return
        try:
            present = self.cache.present(keys.values())
            wanted = [k for k in keys.values() if k in present]
            if wanted:
                self.cache.pin(wanted)
        except CacheError as exc:
            log.warning("event=direct_start_failed directory=%s error=%s", self.directory, exc)
            return
        for inode, key in keys.items():
            if key in present:
                self._link_sync(self.tree.nodes[inode], key)
        if self.linked:
            log.info("event=direct_linked files=%d bytes=%d reason=cached_before", len(self.linked),
                     sum(self.linked.values()))

    def _store_sync(self, node: Node) -> None:
        key = self.key(node)
        reader = self._reader(node)
        if key is None or reader is None or node.entry is None:
            return
        began = time.monotonic()
        try:
            stored = self._store_whole(node, reader, key)
        except (CacheError, OSError) as exc:
            self.failed += 1
            log.warning("event=direct_store_failed file=%r key=%s error=%s", self.tree.path_of(node), key, exc)
            return
        if not stored:
            return
        if self._link_sync(node, key):
            log.info("event=direct_linked file=%r bytes=%d seconds=%.3f", self.tree.path_of(node), node.size,
                     time.monotonic() - began)

    def _store_whole(self, node: Node, reader: LayerReader, key: str) -> bool:
        """Put the whole file in the cache as `key`, pinned, from its cached units (unless it is
        there already); False, with nothing stored or pinned, when one of them is not cached or
        the cache has no room."""
        self.cache.pin([key])
        try:
            stored = self.cache.contains(key) or self._copy_whole(node, reader, key)
        except BaseException:
            self.cache.unpin([key])
            raise
        if not stored:
            self.cache.unpin([key])
        return stored

    def _copy_whole(self, node: Node, reader: LayerReader, key: str) -> bool:
        cache = self.cache
        assert node.entry is not None
        units = reader.units(node.entry)
        unit_keys = [reader.key_for(u) for u in units if not u.zeros]
        if not set(unit_keys) <= cache.present(unit_keys):
            return False
        with cache.writer(key) as w:
            for u in units:
                if u.file_offset != w.size:
                    raise CacheError(f"chunks of {node.entry.name!r} leave a gap at {w.size}")
                if u.zeros:
                    for at in range(0, u.size, len(_ZEROS)):
                        w.write(_ZEROS[:min(len(_ZEROS), u.size - at)])
                    continue
                try:
                    # A chunk file is never changed in place (a new one is renamed over it), so an
                    # open file of the recorded size holds the chunk, evicted since or not.
                    fd = os.open(cache.path_for(reader.key_for(u)), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:  # evicted since the check: try again at the next end read
                    return False
                try:
                    if os.fstat(fd).st_size != u.size:
                        return False
                    w.copy_from(fd, 0, u.size)
                finally:
                    os.close(fd)
            if w.size != node.size:
                raise CacheError(f"chunks of {node.entry.name!r} hold {w.size} bytes, not its {node.size}")
            if not w.commit():
                log.info("event=direct_no_room file=%r bytes=%d", self.tree.path_of(node), node.size)
                return False
        return True

    def _link_sync(self, node: Node, key: str) -> bool:
        """Hard-link cache entry `key` (pinned) into the directory at the node's redirect path;
        when that fails, the pin is dropped."""
        relative = self.tree.path_of(node)
        if any(part in ("", ".", "..") for part in relative.split("/")):  # index names never are
            log.warning("event=direct_link_refused file=%r", relative)
            with contextlib.suppress(CacheError):
                self.cache.unpin([key])
            return False
        target = self.directory / relative
        tmp = target.parent / f".direct-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(self.cache.path_for(key), tmp)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.failed += 1
            log.warning("event=direct_link_failed file=%r error=%s", self.tree.path_of(node), exc)
            with contextlib.suppress(CacheError):
                self.cache.unpin([key])  # it stays cached, for the collection to judge
            return False
        self.linked[node.inode] = node.size
        return True

