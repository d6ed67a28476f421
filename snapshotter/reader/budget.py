"""A trio semaphore counted in bytes: caps the memory held by fetches in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class ByteBudget:
    """FIFO byte semaphore. A request larger than the capacity is clamped to it (it then runs
    alone), so no request waits forever."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self._used = 0
        self._waiters: deque[tuple[int, trio.Event]] = deque()

    @property
    def in_use(self) -> int:
        return self._used

    def _clamp(self, n: int) -> int:
        return min(max(n, 0), self.capacity)

    def acquire_nowait(self, n: int) -> bool:
        """Take n bytes if they are free now and nobody is queued; True on success."""
        n = self._clamp(n)
        if self._waiters or self._used + n > self.capacity:
            return False
        self._used += n
        return True

    async def acquire(self, n: int) -> int:
        """Wait for n bytes (clamped); returns the amount to pass to `release`."""
        n = self._clamp(n)
        if self.acquire_nowait(n):
            await trio.lowlevel.checkpoint()
            return n
        entry = (n, trio.Event())
        self._waiters.append(entry)
        try:
            await entry[1].wait()
        except BaseException:
            if entry[1].is_set():
                self.release(n)
            else:
                self._waiters.remove(entry)
                self._wake()
            raise
        return n

    def release(self, n: int) -> None:
        self._used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._used + self._waiters[0][0] <= self.capacity:
            n, event = self._waiters.popleft()
            self._used += n
            event.set()

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        got = await self.acquire(n)
        try:
            yield
        finally:
            self.release(got)
