"""Layer indexes that garbage collection must keep although no snapshot refers to them yet.

A lazy Prepare saves the layer's index, then creates the remote snapshot that refers to it; a
layer resolved ahead (resolve_ahead.py) is saved long before its own Prepare comes. A Cleanup in
between (containerd sends them whenever its own GC ran, e.g. during the next pull) would see an
index nothing refers to, delete it, and leave a snapshot pointing at nothing.

So every Prepare holds a claim on its layer from before its resolve until its snapshot exists,
and a layer resolved ahead holds one for `ahead_grace` seconds (or until its Prepare takes it
over). GC reads the claims and walks the snapshots under `lock`, the same lock a Prepare takes to
drop its claim: a layer is then either still claimed or already referenced.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class LayerClaims:
    def __init__(self, ahead_grace: float = 600.0) -> None:
        self.lock = threading.Lock()
        self.ahead_grace = ahead_grace
        self._preparing: Counter[str] = Counter()
        self._ahead: dict[str, float] = {}

    @contextmanager
    def preparing(self, layer_digest: str) -> Iterator[None]:
        """Claim `layer_digest` for the body (resolve, save, create the snapshot)."""
        with self.lock:
            self._preparing[layer_digest] += 1
            self._ahead.pop(layer_digest, None)
        try:
            yield
        finally:
            with self.lock:
                self._preparing[layer_digest] -= 1
                if self._preparing[layer_digest] <= 0:
                    del self._preparing[layer_digest]

    def resolved_ahead(self, layer_digest: str) -> None:
        """Claim `layer_digest` (about to be saved ahead of its Prepare) for `ahead_grace` seconds."""
        with self.lock:
            self._ahead[layer_digest] = time.monotonic()

    def claimed(self) -> set[str]:
        """The claimed layers; call with `lock` held. Expired ahead claims are dropped."""
        now = time.monotonic()
        for digest, since in list(self._ahead.items()):
            if now - since > self.ahead_grace:
                del self._ahead[digest]
        return set(self._preparing) | set(self._ahead)
