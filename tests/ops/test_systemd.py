"""The systemd unit and tmpfiles.d file pass systemd's own checks (no running systemd needed).

`systemd-analyze verify` needs the ExecStart binary to exist, so it checks a copy of the unit
whose ExecStart names this checkout's venv `snapshotter`; everything else is the shipped unit.
"""

from __future__ import annotations

import configparser
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "snapshotter.service"
TMPFILES = REPO / "systemd" / "snapshotter.tmpfiles"
VENV_BIN = REPO / ".venv" / "bin" / "snapshotter"


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        pytest.fail(f"{name} not found: integration/setup.sh installs the systemd package")
    return path


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    text = UNIT.read_text()
    exec_lines = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert len(exec_lines) == 1
    shipped = exec_lines[0].split("=", 1)[1].split()
    assert shipped[0].endswith("/snapshotter") and shipped[1] == "serve"
    assert VENV_BIN.exists(), "the venv's snapshotter entry point (scripts/test.sh installs it)"
    unit = tmp_path / "snapshotter.service"
    unit.write_text(text.replace(exec_lines[0], "ExecStart=" + " ".join([str(VENV_BIN), *shipped[1:]])))
    r = subprocess.run([_tool("systemd-analyze"), "verify", str(unit)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # verify only warns about unknown keys and bad values: any line about our unit is a failure.
    ours = [line for line in r.stderr.splitlines() if "snapshotter.service" in line]
    assert not ours, "\n".join(ours)


def test_unit_matches_what_the_daemon_does() -> None:
    unit = _unit()
    service = unit["Service"]
    assert service["Type"] == "notify"  # the daemon sends READY=1 (tests/test_daemon_process.py)
    assert service["KillMode"] == "process"  # mount processes outlive a daemon restart
    assert service["RuntimeDirectory"] == "snapshotter"  # /run/snapshotter: the default socket's dir
    assert service["StateDirectory"] == "snapshotter"  # /var/lib/snapshotter: the default root
    assert "containerd.service" in unit["Unit"]["Before"]
    from snapshotter.config import DEFAULT_ADDRESS, DEFAULT_ROOT

    assert DEFAULT_ADDRESS.parent == Path("/run") / service["RuntimeDirectory"]
    assert DEFAULT_ROOT == Path("/var/lib") / service["StateDirectory"]


def test_tmpfiles_creates_the_directories(tmp_path: Path) -> None:
    r = subprocess.run([_tool("systemd-tmpfiles"), "--create", f"--root={tmp_path}", str(TMPFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not r.stderr.strip(), r.stderr
    for path, mode in (("run/snapshotter", 0o700), ("var/lib/snapshotter", 0o700), ("etc/snapshotter", 0o755)):
        st = (tmp_path / path).stat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == mode, path
