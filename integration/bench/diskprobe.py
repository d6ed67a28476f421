"""A control for the warm read: how this machine's disk reads a file it has just written.

The warm-read cells compare reading a 256 MiB file from our cache (a file the first run wrote
seconds before) with reading it from overlayfs's snapshot (written by the pull). On some virtual
disks the first read of newly written blocks is several times slower than any later read of the
same blocks (seen on this lab's VM: 0.28-0.79 s against 0.07 s for a 256 MiB file, whatever
wrote it; blocks overwritten in place read fast at once), and how often that happens changes
from hour to hour. The probe measures that with no container, FUSE or overlay involved, in the
same run as the cells and right after a reset (as a warm cell's first run writes), so a reader
can weigh the disk against the read path. It writes new random bytes: on this VM, files of the
bench image's own bytes (stored and read many times before) have read fast the first time in
minutes when new random files did not (bench RESULTS.md, s53).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PIECE = 1 << 20  # written in 1 MiB pieces
READ_SIZE = 128 << 10  # read as `cat` reads


@dataclass(frozen=True)
class DiskProbe:
    """One probe: the seconds of the first and the second read of a fresh `size`-byte file."""

    net: str
    rep: int
    size: int
    first_s: float
    second_s: float


def _read_all(path: Path) -> float:
    began = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(READ_SIZE):
            pass
    return time.monotonic() - began


def probe_fresh_file(directory: Path, size: int, settle: float,
                     drop_page_cache: Callable[[], None]) -> tuple[float, float]:
    """Write `size` random bytes to a new file in `directory` (as a cache or an unpack would:
    plain writes, no fsync of its own), wait `settle` seconds, drop the page cache (which syncs)
    and read the file; drop it again and read it again. Returns (first, second) read seconds.
    The file is removed, also when something fails."""
    if size <= 0:
        raise ValueError("a disk probe needs a positive size")
    path = directory / f".disk-probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(PIECE, left)
                f.write(os.urandom(n))
                left -= n
        time.sleep(settle)
        drop_page_cache()
        first = _read_all(path)
        drop_page_cache()
        second = _read_all(path)
    finally:
        path.unlink(missing_ok=True)
    return first, second


def describe(probes: Sequence[DiskProbe], settle: float) -> str:
    """The report's sentence about `probes` (non-empty): medians and ranges of both reads."""
    if not probes:
        raise ValueError("no disk probes to describe")
    first = [p.first_s for p in probes]
    second = [p.second_s for p in probes]
    sizes = sorted({p.size for p in probes})
    size = " / ".join(f"{s / (1 << 20):g} MiB" for s in sizes)
    return (f"Disk control, no container: a new {size} file of random bytes written, left {settle:g} s, page "
            "cache dropped, read "
            f"({len(probes)} probes, one per network and round, in the same run): first read "
            f"{statistics.median(first):.2f} s ({min(first):.2f}–{max(first):.2f}), second read "
            f"{statistics.median(second):.2f} s ({min(second):.2f}–{max(second):.2f}). A first read much slower "
            "than the second means the disk was slow on newly written blocks at that time; both warm reads "
            "read blocks written seconds before (ours: the copy the first run wrote into our cache; "
            "overlayfs: the file the pull unpacked). Probes that are fast do not rule the disk out for the "
            "cells, as the effect comes and goes; slow ones are the worst case: new bytes, where the cells' "
            "files hold bytes the disk has stored before.")
