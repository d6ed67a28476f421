"""Process-wide memory settings for the daemon and the mount processes.

Two glibc malloc habits make a Python process that moves chunk-sized buffers keep memory it no
longer uses:
- Every thread that allocates gets its own arena (up to 8 per core), and memory freed in one arena
  is not reused by another: worker threads that decompress and hash chunks grow the process by tens
  of MiB it never gives back. Two arenas are plenty for a handful of busy threads.
- Blocks above the mmap threshold (128 KiB) get their own mapping and go back to the kernel when
  freed, but freeing one raises the threshold to its size (up to 32 MiB). After the first big
  buffer is freed, every later one comes from the heap, whose freed space stays resident while
  anything above it lives. Fixed thresholds stop that.

The two kinds of process want different thresholds:
- The daemon parses TOCs and writes indexes: small objects and a few big strings. Big buffers get
  their own mappings (256 KiB up), and the heap gives back what is free at its top beyond 1 MiB.
- A mount process answers FUSE reads with 1 MiB buffers, hundreds a second. Mapping, faulting in
  and unmapping each one (or trimming the heap under it) cost a warm sequential read a third of its
  speed, so its threshold sits above 1 MiB (chunk buffers, 4 MiB for our eStargz, still get their
  own mappings) and its heap keeps up to 4 MiB free at the top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# mallopt parameter numbers, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@dataclass(frozen=True)
class MallocSettings:
    arenas: int
    mmap_threshold: int
    trim_threshold: int


DAEMON = MallocSettings(arenas=2, mmap_threshold=256 << 10, trim_threshold=1 << 20)
MOUNT_PROCESS = MallocSettings(arenas=2, mmap_threshold=2 << 20, trim_threshold=4 << 20)


def tune_malloc(settings: MallocSettings) -> bool:
    """Apply `settings` with mallopt (call before starting threads). False when the C library has
    no mallopt (not glibc) or refuses a setting; the settings it accepted stay."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = True
    for name, param, value in (("M_ARENA_MAX", _M_ARENA_MAX, settings.arenas),
                               ("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, settings.mmap_threshold),
                               ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, settings.trim_threshold)):
        if not mallopt(param, value):
            log.debug("mallopt(%s, %d) refused", name, value)
            ok = False
    return ok
