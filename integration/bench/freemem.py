"""The warm cells' free memory: page cache on memory the guest holds, not memory it gave back.

This lab's VM has a virtio balloon with free page reporting (VIRTIO_BALLOON_F_REPORTING): some
two seconds after memory is freed the guest reports it and the host takes it back, so the next
use of each such page faults on the host. A read of 256 MiB whose page cache lands on reported
pages takes 0.3-0.5 s instead of 0.07 s. Measured 2026-12-07 with no container: the same file,
same disk blocks, read right after a drop of the page cache: 0.075 s; 5 s after the drop: 0.45 s
(bench RESULTS.md, s59). Which variant's warm read landed on which pages depended on what the run
before had freed and when, so the warm table compared the host's page faults, not read paths:
the "slow disk on new blocks" of sessions s48-s53 was this.

`refill_free_memory` reads a sparse file (its holes get page cache of the same large folios a
file read takes, with no disk IO) and removes it: the pages are free again, held by the guest,
and the ones the next reads get for the seconds before they are reported. Every variant's
measured warm run starts right after one. The probe (`probe_memory`) shows, with no container,
FUSE or overlay, how big the effect was in the same run and that the refill removes it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PIECE = 1 << 20  # the probe's file is written in 1 MiB pieces
READ_SIZE = 128 << 10  # read as `cat` reads
BALLOON_DEVICE = 0x0005  # virtio device id of the memory balloon
REPORTING_FEATURE = 5  # VIRTIO_BALLOON_F_REPORTING: the bit in the device's features


def free_page_reporting(devices: Path = Path("/sys/bus/virtio/devices")) -> bool:
    """Whether a virtio balloon of this machine reports free pages to its host (sysfs: each
    device's `device` id and its `features` as a string of 0/1 per bit)."""
    for dev in devices.glob("*"):
        try:
            device = int((dev / "device").read_text().strip(), 16)
            features = (dev / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if device == BALLOON_DEVICE and features[REPORTING_FEATURE:REPORTING_FEATURE + 1] == "1":
            return True
    return False


def _read_all(path: Path) -> float:
    began = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(READ_SIZE):
            pass
    return time.monotonic() - began


def refill_free_memory(directory: Path, size: int) -> float:
    """Read a new sparse file of `size` bytes in `directory` and remove it: `size` bytes of page
    cache are taken and freed again, held by the guest. The seconds it took. The file is removed
    also when the read fails. `directory` must be on a disk file system: tmpfs reads holes from
    the shared zero page, without page cache."""
    if size <= 0:
        raise ValueError("a memory refill needs a positive size")
    path = directory / f".refill-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with open(path, "wb") as f:
            f.truncate(size)
        return _read_all(path)
    finally:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class MemoryProbe:
    """One probe: seconds to read a `size`-byte file after a drop of the page cache, and after
    the same drop followed by the refill the warm cells get."""

    net: str
    rep: int
    size: int
    dropped_s: float
    refilled_s: float


def probe_memory(directory: Path, size: int, settle: float, refill: int,
                 drop_page_cache: Callable[[], None]) -> tuple[float, float]:
    """Write `size` random bytes to a new file in `directory`; then twice: wait `settle` seconds
    and drop the page cache (which syncs), the second time followed by a refill of `refill` bytes
    (what the warm cells get); and read the file. Returns (dropped, refilled) read seconds: the
    warm cells' measured read without and with the refill. The file is removed, also when
    something fails."""
    if size <= 0:
        raise ValueError("a memory probe needs a positive size")
    path = directory / f".memory-probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(PIECE, left)
                f.write(os.urandom(n))
                left -= n
        time.sleep(settle)
        drop_page_cache()
        dropped = _read_all(path)
        time.sleep(settle)
        drop_page_cache()
        refill_free_memory(directory, refill)
        refilled = _read_all(path)
    finally:
        path.unlink(missing_ok=True)
    return dropped, refilled


def describe(probes: Sequence[MemoryProbe], settle: float, reporting: bool) -> str:
    """The report's sentence about `probes` (non-empty): medians and ranges of both reads, and
    whether this machine reports free pages to a host."""
    if not probes:
        raise ValueError("no memory probes to describe")
    dropped = [p.dropped_s for p in probes]
    refilled = [p.refilled_s for p in probes]
    sizes = sorted({p.size for p in probes})
    size = " / ".join(f"{s / (1 << 20):g} MiB" for s in sizes)
    balloon = ("This machine's memory balloon reports free pages to its host" if reporting
               else "This machine has no memory balloon that reports free pages")
    return (f"Memory control, no container: a {size} file read {settle:g} s after the page cache was dropped "
            f"{statistics.median(dropped):.2f} s ({min(dropped):.2f}–{max(dropped):.2f}); after the same drop "
            "and the refill every measured warm run gets (a sparse file at least twice as big, read and removed) "
            f"{statistics.median(refilled):.2f} s ({min(refilled):.2f}–{max(refilled):.2f}); "
            f"{len(probes)} probes, one per network and round. {balloon}: about 2 s after memory is freed "
            "the host takes it back, and page cache put on such memory makes a read several times slower "
            "(the first number), whichever file it reads; the refill leaves held memory at the front of the "
            "free lists.")
