"""Pausing the cyclic garbage collector around bulk object building.

Building a layer's index (or its persisted rows) creates about ten objects per file and no
reference cycles. Each 700 allocations start a collection, and every tenth of those rescans
everything alive, the half-built index included: for a 100k-file layer the collector's passes
cost as much as the building. Nothing collectable is made meanwhile, so pausing loses nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collections inside the block; the collector's state before it comes back after.
    Nests (an inner block leaves it paused), and threads share the switch: keep blocks to object
    building that makes no cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
