"""Case 9 of docs/faults.md: the daemon's sockets are root-only.

The gRPC socket is 0660 root:root in a 0700 directory (the admin socket next to it 0600); a
non-root user (`nobody`, via setuid in a child process) can connect to neither, even when the
directory is opened up. (That credentials never reach logs or status output is checked by
tests/ops/test_observability.py.)
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.config import Config
from snapshotter.daemon import Daemon

_CONNECT_AS_NOBODY = """
import os, socket, sys
os.setgroups([])
os.setgid({gid})
os.setuid({uid})
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(path)
    except PermissionError:
        print("denied", path)
    except OSError as e:
        print("error", e.errno, path)
    else:
        print("connected", path)
    finally:
        s.close()
"""


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Daemon]:
    # Under a directory `nobody` may traverse (pytest's tmp_path is under a 0700 dir), so only
    # the daemon's own modes stand in its way.
    base = Path(tempfile.mkdtemp(prefix="faultsock-"))
    base.chmod(0o755)
    d = Daemon(Config(root=str(tmp_path / "root"), address=str(base / "run" / "snap.sock")))
    d.start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def _connect_as_nobody(*paths: Path) -> list[str]:
    nobody = pwd.getpwnam("nobody")
    code = _CONNECT_AS_NOBODY.format(uid=nobody.pw_uid, gid=nobody.pw_gid)
    r = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n")[:-1]


def test_sockets_are_root_only(running: Daemon) -> None:
    sock = Path(running.config.address)
    admin = Path(f"{sock}.admin")
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert (st.st_uid, st.st_gid) == (0, 0)
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
    paths = [sock]
    if admin.exists():
        assert stat.S_IMODE(os.lstat(admin).st_mode) == 0o600
        paths.append(admin)
    assert all(line.startswith("denied") for line in _connect_as_nobody(*paths))
    # Even with the directory opened up, the socket's own mode keeps `nobody` out.
    sock.parent.chmod(0o755)
    try:
        assert all(line.startswith("denied") for line in _connect_as_nobody(*paths))
    finally:
        sock.parent.chmod(0o700)


def test_the_check_itself_can_see_a_world_writable_socket(running: Daemon) -> None:
    """The probe is not vacuous: with the modes opened, `nobody` connects."""
    sock = Path(running.config.address)
    sock.parent.chmod(0o755)
    sock.chmod(0o666)
    try:
        assert _connect_as_nobody(sock) == [f"connected {sock}"]
    finally:
        sock.chmod(0o660)
        sock.parent.chmod(0o700)
