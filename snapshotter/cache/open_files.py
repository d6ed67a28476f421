"""A small LRU of open chunk files, shared by the threads of one process.

Reading a cached chunk the slow way costs an index query, an open, an fstat and a close around
the one pread that matters; a sequential reader of a big file asks for the same chunk several
times in a row (a FUSE read is at most 1 MiB, a chunk several). Keeping the last few chunk files
open turns the repeats into a pread.

A held file may outlive its index row: another process can evict the chunk, or an operator can
remove it. Its bytes are still the chunk's (files are written once under a temp name and renamed
into place, never rewritten), so serving them stays correct; the disk space comes back when the
file leaves this LRU. A short read (a file truncated under us) is the caller's to treat as a miss.

Each checkout counts a user: a file pushed out of the LRU or dropped is closed only when its last
user checks it in, so no thread ever preads a descriptor number that was closed and reused.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class OpenChunk:
    """An open chunk file. size: its length when opened; touched: when its LRU row was last
    refreshed (by this process), on the time.time() clock."""

    fd: int
    size: int
    touched: float
    users: int = 0
    dropped: bool = False


class OpenChunkFiles:
    """Up to `capacity` open chunk files by key, of at most `max_bytes` together (the files the
    read-ahead window warms, plus those being read: a 32 MiB window is 8 chunks of 4 MiB or 32
    of 1 MiB; the byte bound caps the disk space that files evicted elsewhere keep). Thread-safe."""

    def __init__(self, capacity: int = 128, max_bytes: int = 64 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._files: OrderedDict[str, OpenChunk] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def checkout(self, key: str) -> OpenChunk | None:
        """The held file of `key` with one more user, or None. Pair with `checkin`."""
        with self._lock:
            held = self._files.get(key)
            if held is None:
                return None
            self._files.move_to_end(key)
            held.users += 1
            return held

    def adopt(self, key: str, fd: int, size: int, touched: float) -> OpenChunk:
        """Hold a file the caller just opened (this object closes it from now on); returns it
        checked out once. If another thread adopted `key` meanwhile, both stay valid until
        their users check them in; only the newer is kept."""
        held = OpenChunk(fd=fd, size=size, touched=touched, users=1)
        if self.capacity <= 0:
            held.dropped = True
            return held
        with self._lock:
            old = self._files.pop(key, None)
            self._files[key] = held
            self._bytes += size
            if old is not None:
                self._drop_locked(old)
            while len(self._files) > 1 and (len(self._files) > self.capacity or self._bytes > self.max_bytes):
                self._drop_locked(self._files.popitem(last=False)[1])
        return held

    def checkin(self, held: OpenChunk) -> None:
        with self._lock:
            held.users -= 1
            if held.dropped and held.users == 0:
                os.close(held.fd)

    def drop(self, key: str) -> None:
        """Forget `key` (evicted or discarded here); its file closes once unused."""
        with self._lock:
            held = self._files.pop(key, None)
            if held is not None:
                self._drop_locked(held)

    def clear(self) -> None:
        with self._lock:
            while self._files:
                self._drop_locked(self._files.popitem()[1])

    def __len__(self) -> int:
        return len(self._files)

    def _drop_locked(self, held: OpenChunk) -> None:
        """`held` has just left `_files`: count it out, close it once unused."""
        self._bytes -= held.size
        held.dropped = True
        if held.users == 0:
            os.close(held.fd)
