"""ChunkCache against a model: random put/get/pin/unpin/evict/gc keep the invariants."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from snapshotter.cache import ChunkCache
from tests.cache.helpers import chunk, tree_files

CAP = 10_000
SEEDS = st.integers(0, 15)


def sized(seed: int) -> tuple[str, bytes]:
    return chunk(seed, 500 + 300 * seed)


class CacheModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="cachemodel-")
        self.cache = ChunkCache(self.dir, CAP, touch_interval=0)
        self.pins: dict[str, int] = {}

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def pinned_bytes(self) -> int:
        return sum(len(sized(s)[1]) for s in range(16) if self.pins.get(sized(s)[0]) and
                   self.cache.contains(sized(s)[0]))

    @rule(seed=SEEDS)
    def put(self, seed: int) -> None:
        key, data = sized(seed)
        had = self.cache.contains(key)
        room = CAP - self.pinned_bytes() >= len(data)
        stored = self.cache.put(key, data)
        assert stored == (had or room)
        if stored:
            assert self.cache.get(key) == data

    @rule(seed=SEEDS)
    def get(self, seed: int) -> None:
        key, data = sized(seed)
        got = self.cache.get(key)
        assert got is None or got == data
        assert (got is not None) == self.cache.contains(key)

    @rule(seed=SEEDS, off=st.integers(0, 6000), size=st.integers(0, 6000))
    def ranged_get(self, seed: int, off: int, size: int) -> None:
        key, data = sized(seed)
        got = self.cache.get(key, off, size)
        assert got is None or got == data[off:off + size]

    @rule(seed=SEEDS)
    def pin(self, seed: int) -> None:
        key = sized(seed)[0]
        self.cache.pin([key])
        self.pins[key] = self.pins.get(key, 0) + 1

    @rule(seed=SEEDS)
    def unpin(self, seed: int) -> None:
        key = sized(seed)[0]
        if self.pins.get(key):
            self.cache.unpin([key])
            self.pins[key] -= 1

    @rule(limit=st.integers(0, CAP))
    def evict(self, limit: int) -> None:
        pinned_before = {k for k, n in self.pins.items() if n and self.cache.contains(k)}
        self.cache.evict_to(limit)
        assert self.cache.usage().bytes <= max(limit, self.pinned_bytes())
        assert all(self.cache.contains(k) for k in pinned_before)

    @rule(keep=st.sets(SEEDS, max_size=8))
    def gc(self, keep: set[int]) -> None:
        keys = {sized(s)[0] for s in keep}
        self.cache.gc(keys)
        for s in range(16):
            k = sized(s)[0]
            if self.cache.contains(k):
                assert k in keys or self.pins.get(k)

    @invariant()
    def consistent(self) -> None:
        files = tree_files(self.cache.root)
        u = self.cache.usage()
        assert u.bytes == sum(files.values()) <= CAP
        assert u.chunks == len(files)
        # Pinned chunks that are cached stay cached (checked in rules); nothing is over the cap.


TestCacheModel = CacheModel.TestCase
TestCacheModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
