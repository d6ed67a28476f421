"""The malloc settings each kind of process applies are ones glibc accepts (a refused one would
leave the process untuned without a word)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from snapshotter.memory import DAEMON, MOUNT_PROCESS


@pytest.mark.parametrize("name", ["DAEMON", "MOUNT_PROCESS"])
def test_presets_are_accepted_by_glibc(name: str) -> None:
    # In a child: the settings are process-wide and this test process should stay as it was.
    code = f"from snapshotter.memory import {name}, tune_malloc; raise SystemExit(0 if tune_malloc({name}) else 1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_mount_process_keeps_fuse_read_buffers_on_the_heap() -> None:
    """A FUSE read's buffer (1 MiB + header) must come from the heap in a mount process."""
    assert MOUNT_PROCESS.mmap_threshold > (1 << 20) + 4096 and MOUNT_PROCESS.trim_threshold > 1 << 20
    assert DAEMON.mmap_threshold < MOUNT_PROCESS.mmap_threshold
