"""The admin socket: started and stopped with the daemon, root-only, answers the status document."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from snapshotter.cli import main
from snapshotter.config import Config
from snapshotter.daemon import Daemon
from snapshotter.status import admin_socket_path, fetch_status, render_text


def test_admin_socket_lifecycle_and_empty_status(tmp_path: Path) -> None:
    config = Config(root=str(tmp_path / "root"), address=str(tmp_path / "run" / "sn.sock"))
    daemon = Daemon(config)
    daemon.start()
    admin = admin_socket_path(config.address)
    try:
        st = os.stat(admin)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        doc = fetch_status(admin)
        assert doc["version"] == 1 and doc["images"] == [] and doc["mounts"] == []
        assert doc["daemon"] == {"pid": os.getpid(), "root": config.root, "address": config.address}
        assert doc["cache"] == {"bytes": 0, "chunks": 0, "max_bytes": config.cache.max_bytes}
        assert "mounts: none" in render_text(doc)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(admin))
            s.sendall(b"GET /nope HTTP/1.0\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.0 404")
    finally:
        daemon.stop()
    assert not admin.exists(), "stop() removes the admin socket"


def test_status_command_without_a_daemon_says_so(tmp_path: Path, capsys: object) -> None:
    rc = main(["status", "--address", str(tmp_path / "none.sock")])
    assert rc == 1
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "cannot ask the daemon" in err and "none.sock.admin" in err
