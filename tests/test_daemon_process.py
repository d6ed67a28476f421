"""`snapshotter serve` as a process: config errors, socket handling, signals."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT = 20
_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_daemon_left() -> Iterator[None]:
    """A test that fails before it stops its daemon does not leave it (and its spare mount
    process, which exits with it) running."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=START_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _serve(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotter.cli", "serve", "--root", str(tmp_path / "root"),
         "--address", str(tmp_path / "run" / "s.sock"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _started.append(proc)
    return proc


def _wait_socket(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited early: {proc.communicate()[1]}")
        try:
            if path.stat().st_mode & 0o777 == 0o660:
                return
        except FileNotFoundError:
            pass  # not bound yet, or a stale socket the daemon just removed (seen once in CI)
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {START_TIMEOUT}s")


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("root = '/x'\n[cache]\nmax_bytes = 10\nmax_bites = 5\n", ["line 4", "cache.max_bites"]),
        ("resolve_timeout = 'soon'\n", ["line 1", "resolve_timeout", "number"]),
        ("log_level = 'loud'\n", ["line 1", "log_level"]),
        ("[cache\nmax_bytes = 1\n", ["not valid TOML", "line 1"]),
        ("\n\nbogus = 1\n", ["line 3", "'bogus'"]),
    ],
)
def test_garbage_config_exits_naming_file_line_key(tmp_path: Path, text: str, expect: list[str]) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    proc = _serve(tmp_path, "--config", str(cfg))
    _out, err = proc.communicate(timeout=START_TIMEOUT)
    assert proc.returncode != 0
    assert str(cfg) in err
    for piece in expect:
        assert piece in err
    assert not (tmp_path / "root").exists(), "a rejected config must not touch the root"


def test_missing_explicit_config_is_an_error(tmp_path: Path) -> None:
    proc = _serve(tmp_path, "--config", str(tmp_path / "nope.toml"))
    _out, err = proc.communicate(timeout=START_TIMEOUT)
    assert proc.returncode != 0 and "nope.toml" in err and "does not exist" in err


def test_flags_override_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"root = '{tmp_path}/from-file'\naddress = '{tmp_path}/file.sock'\n")
    proc = _serve(tmp_path, "--config", str(cfg))
    try:
        _wait_socket(tmp_path / "run" / "s.sock", proc)
        assert (tmp_path / "root" / "metadata.db").exists()
        assert not (tmp_path / "from-file").exists()
    finally:
        proc.terminate()
        proc.communicate(timeout=START_TIMEOUT)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_stale_socket_is_replaced(tmp_path: Path, sig: signal.Signals) -> None:
    sock = tmp_path / "run" / "s.sock"
    sock.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # bound but never listening: what a killed daemon leaves
    stale.close()
    proc = _serve(tmp_path)
    _wait_socket(sock, proc)
    assert oct(sock.parent.stat().st_mode & 0o777) == oct(0o700)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=START_TIMEOUT)
    assert proc.returncode == 0, err
    assert "event=stale_socket_removed" in err and "event=stopped" in err
    assert not sock.exists()


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """Send `sig` to one thread of a process (what the kernel may do with a process signal)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(234, pid, tid, sig) != 0:  # SYS_tgkill on x86_64
        raise OSError(ctypes.get_errno(), "tgkill failed")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="calls tgkill by its x86_64 syscall number")
def test_a_signal_taken_by_another_thread_still_stops_the_daemon(tmp_path: Path) -> None:
    """The kernel hands a process signal to any thread that does not block it. Python runs the
    handler in the main thread, which must not then sleep on until a long timeout ends (it
    waited up to an hour: a `systemctl stop` would have ended in SIGKILL)."""
    sock = tmp_path / "run" / "s.sock"
    proc = _serve(tmp_path)
    _wait_socket(sock, proc)
    others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
    assert others, "the daemon runs worker threads"
    _tgkill(proc.pid, max(others), signal.SIGTERM)
    _out, err = proc.communicate(timeout=START_TIMEOUT)
    assert proc.returncode == 0 and "event=stopped" in err, err


def test_refuses_socket_a_live_daemon_serves(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "s.sock"
    first = _serve(tmp_path)
    try:
        _wait_socket(sock, first)
        second = _serve(tmp_path)
        _out, err = second.communicate(timeout=START_TIMEOUT)
        assert second.returncode != 0 and "another process is serving" in err
        assert first.poll() is None and sock.exists()
    finally:
        first.terminate()
        first.communicate(timeout=START_TIMEOUT)


def test_sd_notify_ready(tmp_path: Path) -> None:
    notify = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    listener.settimeout(START_TIMEOUT)
    env = dict(os.environ, NOTIFY_SOCKET=str(notify))
    proc = subprocess.Popen([sys.executable, "-m", "snapshotter.cli", "serve", "--root", str(tmp_path / "root"),
                             "--address", str(tmp_path / "run" / "s.sock")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started.append(proc)  # stopped by the fixture if this test fails before it stops it
    try:
        assert listener.recv(256) == b"READY=1"
        assert (tmp_path / "run" / "s.sock").exists()
    finally:
        proc.terminate()
        proc.communicate(timeout=START_TIMEOUT)
        listener.close()
