"""Start/stop mount processes and kernel mounts for the FUSE tests, always cleaning up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def mounted_paths() -> set[str]:
    out = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            field = line.split()[4]
            out.add(field.encode().decode("unicode_escape"))  # octal escapes like \040
    return out


def is_mounted(path: Path) -> bool:
    return str(path) in mounted_paths()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def force_unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


@dataclass
class MountProc:
    proc: subprocess.Popen[bytes]
    mountpoint: Path
    state_path: Path
    ready_path: Path
    record_path: Path
    log_path: Path

    def ready(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.ready_path.read_bytes())
        return data

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL; then make sure nothing stays mounted. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        force_unmount(self.mountpoint)
        return self.proc.returncode


def layer_spec(index_path: Path, reader: dict[str, Any], digest: str = "") -> dict[str, Any]:
    return {"index": str(index_path), "reader": reader, "digest": digest}


def write_state(directory: Path, runs: Sequence[Sequence[dict[str, Any]]], **extra: Any) -> tuple[Path, dict[str, Any]]:
    mnt = directory / "mnt"
    mnt.mkdir(exist_ok=True)
    state = {
        "version": 1, "mountpoint": str(mnt), "ready_file": str(directory / "ready.json"),
        "record_file": str(directory / "record.json"), "runs": [list(r) for r in runs], **extra,
    }
    path = directory / "state.json"
    path.write_text(json.dumps(state))
    return path, state


@contextmanager
def mount_process(directory: Path, runs: Sequence[Sequence[dict[str, Any]]], *,
                  module: str = "snapshotter.fusefs", **extra: Any) -> Iterator[MountProc]:
    """Run `python -m module STATE` until its ready file appears; stop and unmount on exit."""
    state_path, state = write_state(directory, runs, **extra)
    log_path = directory / "mount.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, str(state_path)], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT)
    m = MountProc(proc, Path(state["mountpoint"]), state_path, Path(state["ready_file"]),
                  Path(state["record_file"]), log_path)
    try:
        wait_for(lambda: m.ready_path.exists() or proc.poll() is not None, 30, "the ready file")
        if proc.poll() is not None:
            raise AssertionError(f"mount process exited {proc.returncode}:\n{m.log()}")
        assert is_mounted(m.mountpoint)
        yield m
    finally:
        m.stop()


@contextmanager
def overlay(target: Path, lowerdirs: Sequence[Path]) -> Iterator[Path]:
    """A read-only overlay of `lowerdirs` (highest first) at `target`."""
    target.mkdir(parents=True, exist_ok=True)
    opts = "lowerdir=" + ":".join(str(p) for p in lowerdirs)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(target)], check=True, timeout=30)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False, timeout=30)
        force_unmount(target)


def read_all(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while chunk := os.read(fd, 1 << 20):
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)
