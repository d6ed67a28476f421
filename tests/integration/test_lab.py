"""The lab's own guarantees: teardown leaves no process, mount or dir behind, even after failures.

These start their own short-lived labs (about a second each) on containerd's overlayfs
snapshotter, so they do not depend on our daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from integration.lab import Lab, LabError, mounts_under, pids_mentioning


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_close_stops_tasks_shims_strays_and_unmounts(tmp_path: Path) -> None:
    lab = Lab(start_daemon=False, base_dir=tmp_path, keep=False)
    with lab:
        ref = lab.push(lab.foundation_image(), "teardown")
        lab.pull(ref, snapshotter="overlayfs")
        cid = f"long-{uuid.uuid4().hex[:8]}"
        lab.ctr_run(ref, cid, "sleep", "600", snapshotter="overlayfs", detach=True, timeout=60)
        rows = [r.split() for r in lab.ctr("tasks", "ls").stdout.splitlines()[1:]]
        container_pid = int(next(r[1] for r in rows if r[0] == cid))
        assert _alive(container_pid)
        shims = pids_mentioning(f"{lab.dir}/", exclude={os.getpid()})
        assert shims, "expected a containerd shim naming the lab's socket"
        # A stray mount and a stray process naming the lab dir, as a crashed daemon might leave.
        (lab.dir / "stray-mnt").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(lab.dir / "stray-mnt")], check=True, timeout=10)
        stray = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", f"{lab.dir}/stray"], start_new_session=True
        )
        lab_dir = lab.dir
        pids = [p.pid for p in lab.procs]
    stray.wait(timeout=10)
    for pid in [container_pid, *shims, *pids]:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), pid
    assert not mounts_under(lab_dir)
    assert not lab_dir.exists()


def test_daemon_that_dies_at_start_fails_fast_with_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "fake-snapshotter"
    fake.write_text("#!/bin/sh\necho 'fake daemon: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    lab = Lab(snapshotter_bin=fake, base_dir=tmp_path / "labs", keep=False)
    (tmp_path / "labs").mkdir()
    started = time.monotonic()
    with pytest.raises(LabError) as err:
        lab.start()
    assert time.monotonic() - started < 20
    assert "snapshotter exited with status 3" in str(err.value)
    assert "fake daemon: cannot start" in str(err.value)
    assert list((tmp_path / "labs").iterdir()) == []
    assert all(p.popen.poll() is not None for p in lab.procs)


FAKE_DAEMON = """#!{python}
import socket, subprocess, sys, time
addr = sys.argv[sys.argv.index("--address") + 1]
child = subprocess.Popen(["sleep", "600"])  # names nothing of the lab: found by its session
open(addr + ".child", "w").write(str(child.pid))
s = socket.socket(socket.AF_UNIX)
s.bind(addr)
s.listen()
time.sleep(600)
"""


def test_close_stops_children_of_the_daemon_that_name_nothing(tmp_path: Path) -> None:
    fake = tmp_path / "fake-snapshotter"
    fake.write_text(FAKE_DAEMON.format(python=sys.executable))
    fake.chmod(0o755)
    with Lab(snapshotter_bin=fake, base_dir=tmp_path, keep=False) as lab:
        child = int(Path(f"{lab.snapshotter_socket}.child").read_text())
        assert _alive(child)
        lab_dir = lab.dir
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert not lab_dir.exists()
