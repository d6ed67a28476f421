"""What /proc/self/mountinfo says about a path (no stat: a stat of a FUSE mountpoint is a request
its server may not be able to answer, or a hang on a dead mount)."""

from __future__ import annotations

import os


def mount_device(path: str | os.PathLike[str]) -> str | None:
    """"MAJOR:MINOR" of the file system mounted at `path` in this mount namespace (the one on top
    when several are stacked there), or None when nothing is mounted there. Dead FUSE mounts count."""
    target = os.fsencode(os.path.abspath(path))
    device = None
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split(b" ")
            if len(fields) > 4 and fields[4].replace(b"\\040", b" ") == target:
                device = fields[2].decode()  # later lines are mounted on top of earlier ones
    return device


def is_mountpoint(path: str | os.PathLike[str]) -> bool:
    """True when something is mounted at `path` in this mount namespace (dead FUSE mounts included)."""
    return mount_device(path) is not None
