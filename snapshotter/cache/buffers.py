"""Reusable read buffers for replies that leave the process right away (FUSE reads).

A FUSE read of a cached chunk reads up to 1 MiB from the page cache into a buffer that pyfuse3
sends and drops. A fresh `bytearray(n)` per read is zero-filled and, once freed and allocated
again, faulted in anew: about a quarter of the cost of the read itself. `ReadBuffers` hands out
views of a few buffers that it allocated once.

Contract: `take(n)` returns a writable memoryview of exactly n bytes; the caller fills it and
passes it on. A buffer is handed out again only when nothing refers to it any more but this
pool: no view of it, no buffer export (pyfuse3 takes the reply with PyObject_GetBuffer, which
holds a reference until the reply is written). Whether that holds is read from CPython's
reference count, so no caller has to give a buffer back. Thread-safe.
"""

from __future__ import annotations

import sys
import threading


class ReadBuffers:
    """Up to `count` buffers of `size` bytes; a request larger than `size`, or one made while
    every buffer is in use, gets a fresh bytearray."""

    def __init__(self, size: int = 1 << 20, count: int = 8) -> None:
        if size <= 0 or count < 0:
            raise ValueError(f"bad read buffer pool size={size} count={count}")
        self.size = size
        self.count = count
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()
        # The count `take` sees for a buffer only a pool list refers to, measured the same way
        # (interpreters differ in the temporary references such a loop holds).
        self._free_refcount = next(map(sys.getrefcount, [bytearray(1)]))

    def take(self, n: int) -> memoryview:
        if n > self.size or n <= 0:
            return memoryview(bytearray(max(n, 0)))
        with self._lock:
            for i, refs in enumerate(map(sys.getrefcount, self._buffers)):
                if refs == self._free_refcount:
                    return memoryview(self._buffers[i])[:n]
            if len(self._buffers) < self.count:
                buf = bytearray(self.size)
                self._buffers.append(buf)
                return memoryview(buf)[:n]
        return memoryview(bytearray(n))
