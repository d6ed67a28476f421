"""Process-wide memory settings for the daemon and the mount processes.

glibc gives every thread that allocates its own malloc arena (up to 8 per core), and memory freed
in one arena is not reused by another: a process whose worker threads decompress and hash chunks
grows by tens of MiB it never gives back. Two arenas are plenty for a handful of busy threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter number, glibc's malloc.h


def limit_malloc_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas at `count` (call before starting threads). False when the C
    library has no mallopt (not glibc); nothing changes then."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_ARENA_MAX, count))
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", count)
    return ok
