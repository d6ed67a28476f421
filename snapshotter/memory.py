"""Process-wide memory settings for the daemon and the mount processes.

Two glibc malloc habits make a Python process that moves chunk-sized buffers keep memory it no
longer uses:
- Every thread that allocates gets its own arena (up to 8 per core), and memory freed in one arena
  is not reused by another: worker threads that decompress and hash chunks grow the process by tens
  of MiB it never gives back. Two arenas are plenty for a handful of busy threads.
- Blocks above the mmap threshold (128 KiB) get their own mapping and go back to the kernel when
  freed, but freeing one raises the threshold to its size (up to 32 MiB). After the first chunk
  buffer is freed, every later chunk buffer comes from the heap, whose freed space stays resident
  while anything above it lives. A fixed threshold keeps chunk buffers (4 MiB for our eStargz) in
  their own mappings.

The threshold sits above 1 MiB on purpose: the 1 MiB buffers of FUSE reads come and go hundreds of
times a second, and mapping, faulting in and unmapping each one cost a warm sequential read a
fifth of its speed. For the same reason the heap keeps up to 16 MiB free at its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameter numbers, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 2 << 20  # above a FUSE read buffer (1 MiB), below a chunk
TRIM_THRESHOLD = 16 << 20


def tune_malloc(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas at `arenas` and fix its mmap and trim thresholds (call before
    starting threads). False when the C library has no mallopt (not glibc) or refuses a setting;
    the settings it accepted stay."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = True
    for name, param, value in (("M_ARENA_MAX", _M_ARENA_MAX, arenas),
                               ("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                               ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if not mallopt(param, value):
            log.debug("mallopt(%s, %d) refused", name, value)
            ok = False
    return ok
