"""Code run in child processes by the cache tests (importable, so `spawn` can find it)."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from pathlib import Path

from snapshotter.cache import ChunkCache


def chunk(seed: int, size: int) -> tuple[str, bytes]:
    """A deterministic chunk and its sha256 key."""
    data = random.Random(seed).randbytes(size)
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def tree_files(root: Path) -> dict[Path, int]:
    """Every non-temp chunk file under root and its size."""
    out = {}
    for dirpath, _dirs, files in os.walk(root / "chunks"):
        for name in files:
            if not name.startswith(".tmp."):
                p = Path(dirpath, name)
                out[p] = p.stat().st_size
    return out


def temp_files(root: Path) -> list[Path]:
    return [Path(d, n) for d, _, fs in os.walk(root / "chunks") for n in fs if n.startswith(".tmp.")]


def worker(root: str, max_bytes: int, seed: int, ops: int, pool: int, size: int) -> dict[str, int]:
    """Random put/get/pin/evict on a shared cache; checks every byte it reads."""
    rng = random.Random(seed)
    stats = {"puts": 0, "hits": 0, "misses": 0, "bad": 0, "over_cap": 0}
    with ChunkCache(root, max_bytes, touch_interval=0) as cache:
        for _ in range(ops):
            key, data = chunk(rng.randrange(pool), size)
            op = rng.random()
            if op < 0.45:
                cache.put(key, data)
                stats["puts"] += 1
            elif op < 0.9:
                got = cache.get(key)
                if got is None:
                    stats["misses"] += 1
                elif got != data:
                    stats["bad"] += 1
                else:
                    stats["hits"] += 1
            elif op < 0.97:
                with cache.pinned([key]):
                    cache.put(key, data)
                    got = cache.get(key)
                    if got is not None and got != data:
                        stats["bad"] += 1
            else:
                cache.evict_to(max_bytes // 2)
            if cache.usage().bytes > max_bytes:
                stats["over_cap"] += 1
    return stats


def _slow_write_main(root: str, mode: str, marker: str, size: int) -> None:
    """Put one chunk and stall at `mode` ("write": half written; "replace": renamed, not
    committed) after creating `marker`, waiting to be SIGKILLed."""
    import snapshotter.cache.store as store

    key, data = chunk(12345, size)
    real_write, real_replace = os.write, os.replace

    def stall() -> None:
        # Atomically, so the test never reads a half-written marker.
        Path(marker + ".part").write_text(key)
        real_replace(marker + ".part", marker)
        time.sleep(120)

    def slow_write(fd: int, buf: bytes | memoryview) -> int:  # type: ignore[override]
        n = real_write(fd, memoryview(buf)[: size // 2])
        stall()
        return n

    def slow_replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        stall()

    class PatchedOs:
        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

    patched = PatchedOs()
    if mode == "write":
        patched.write = slow_write  # type: ignore[attr-defined]
    else:
        patched.replace = slow_replace  # type: ignore[attr-defined]
    store.os = patched  # type: ignore[assignment]
    cache = ChunkCache(root, 1 << 40)
    cache.put(key, data)


def _pin_main(root: str, key: str, marker: str) -> None:
    cache = ChunkCache(root, 1 << 40)
    cache.pin([key])
    Path(marker).write_text("pinned")
    time.sleep(120)


if __name__ == "__main__":
    if sys.argv[1] == "slow-write":
        _slow_write_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif sys.argv[1] == "pin":
        _pin_main(sys.argv[2], sys.argv[3], sys.argv[4])


def open_and_close(root: str) -> bool:
    """Open the cache at root (creating it) and close it: for processes racing to create one."""
    ChunkCache(root, 1 << 20).close()
    return True
