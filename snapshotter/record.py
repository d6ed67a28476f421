"""`snapshotter record`: run a command in a container of an image through our snapshotter and
write the files it read, in first-read order, as a prefetch profile (one path per line, as
`snapshotter convert --prefetch-list` reads it).

How (against a running containerd whose proxy plugin `--snapshotter` is our daemon):
1. `ctr-remote image rpull` the image through the snapshotter (lazy layers stay remote);
2. `ctr run` (not `--rm`) the command in a fresh container, bounded by `timeout`: when it runs
   longer, its task is killed (SIGKILL) and what it read so far is the profile;
3. find the image's mount process from the container snapshot's overlay lowerdirs
   (`ROOT/mounts/<id>/mnt/<run>`, or `ROOT/mounts/<id>/meta/<run>` over its metadata image),
   send it SIGUSR1 and read the record file its state.json names (fusefs/process.py writes
   `{"files": [{"path", "layer", "name"}, ...]}`);
4. delete the container (and its snapshot) whatever happened.
Only reads of lazy layers (eStargz, zstd:chunked, Nydus) go through a mount process; an image
with none is an error, layers unpacked locally are reported and not seen. A mount process that
already served the image before this run (another container of it) leaves earlier reads in the
record and serves some reads from the page cache: reported as a warning.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from snapshotter.errors import SnapshotterError

RECORD_WAIT = 10.0
KILL_WAIT = 15.0


class RecordError(SnapshotterError):
    """Recording could not be done (the message says what to do)."""


@dataclass(frozen=True)
class RecordOptions:
    ref: str
    command: Sequence[str] = ()
    address: str = "/run/containerd/containerd.sock"
    namespace: str = "default"
    snapshotter: str = "lazy"
    plain_http: bool = False
    timeout: float = 30.0
    run_args: Sequence[str] = field(default_factory=tuple)  # extra `ctr run` flags (--runc-root=...)
    ctr: str = "ctr"
    ctr_remote: str = "ctr-remote"


@dataclass(frozen=True)
class RecordResult:
    paths: tuple[str, ...]  # "/usr/bin/env", first read first
    exit_status: int | None  # the command's, None when it was killed at the timeout
    timed_out: bool
    mount_dir: str
    local_layers: int  # lowerdirs that were not lazy (their reads are not recorded)
    warnings: tuple[str, ...] = ()


# A run of an image's mount: its FUSE mount's run dir, or its metadata image's (over the FUSE mount).
_MOUNT_DIR = re.compile(r"^(?P<dir>/.+/mounts/\d+)/(?:mnt|meta)/\d+$")


def _run(argv: Sequence[str], timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise RecordError(f"{argv[0]} is not installed (needed by snapshotter record)") from None
    except subprocess.TimeoutExpired:
        raise RecordError(f"{' '.join(argv)}: no answer within {timeout:.0f}s") from None
    if check and r.returncode != 0:
        raise RecordError(f"{' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def lowerdirs_of(mount_text: str) -> list[str]:
    """The lowerdirs of the overlay mount `ctr snapshots mounts` prints (top first), without the
    data-only layers that follow "::" (an image's FUSE mount under its metadata image)."""
    m = re.search(r"lowerdir=([^,\s]+)", mount_text)
    return m.group(1).split("::")[0].split(":") if m else []


def profile_paths(record: Mapping[str, object]) -> list[str]:
    """Profile lines from a mount process's record document: "/" + the entry's name in its layer
    (the mount path minus its run directory when the name is missing), first read first."""
    out: list[str] = []
    seen: set[str] = set()
    files = record.get("files")
    if not isinstance(files, list):
        raise RecordError("the record file has no 'files' list")
    for f in files:
        if not isinstance(f, dict):
            continue
        name = f.get("name")
        if not isinstance(name, str) or not name:
            path = str(f.get("path", ""))
            name = path.split("/", 1)[1] if "/" in path else path
        if name and name not in seen:
            seen.add(name)
            out.append("/" + name)
    return out


def _ask_record(mount_dir: Path) -> dict[str, object]:
    """SIGUSR1 the mount process of `mount_dir` and read the record it writes."""
    try:
        state = json.loads((mount_dir / "state.json").read_text())
        pid = int((mount_dir / "pid").read_text())
    except (OSError, ValueError) as exc:
        raise RecordError(f"cannot read the mount process state under {mount_dir}: {exc}") from None
    record_file = state.get("record_file")
    if not isinstance(record_file, str) or not record_file:
        raise RecordError(f"{mount_dir}/state.json names no record_file: the daemon is too old for record")
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        raise RecordError(f"the mount process {pid} of {mount_dir} is gone") from None
    if b"snapshotter.fusefs" not in cmdline:
        raise RecordError(f"pid {pid} of {mount_dir} is not a mount process")
    target = Path(record_file)
    target.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + RECORD_WAIT
    while time.monotonic() < deadline:
        try:
            doc = json.loads(target.read_text())
        except FileNotFoundError:
            time.sleep(0.05)
            continue
        except (OSError, ValueError) as exc:
            raise RecordError(f"cannot read the record file {target}: {exc}") from None
        if not isinstance(doc, dict):
            raise RecordError(f"the record file {target} is not a JSON object")
        return doc
    raise RecordError(f"the mount process {pid} wrote no record to {target} within {RECORD_WAIT:.0f}s")


def record(opts: RecordOptions, command_output: TextIO | None = None) -> RecordResult:
    """Run the recording (see the module docstring); the command's output goes to `command_output`."""
    out = command_output or sys.stderr
    base = [opts.ctr, "--address", opts.address, "-n", opts.namespace]
    rpull = [opts.ctr_remote, "--address", opts.address, "-n", opts.namespace, "image", "rpull"]
    if opts.plain_http:
        rpull.append("--plain-http")
    _run([*rpull, "--snapshotter", opts.snapshotter, opts.ref], timeout=600.0)
    cid = f"snapshotter-record-{os.getpid()}-{secrets.token_hex(3)}"
    warnings: list[str] = []
    started = time.time()
    proc = subprocess.Popen([*base, "run", "--snapshotter", opts.snapshotter, *opts.run_args, opts.ref, cid,
                             *opts.command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        timed_out = False
        try:
            text, _ = proc.communicate(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _run([*base, "tasks", "kill", "-s", "SIGKILL", cid], timeout=30.0, check=False)
            try:
                text, _ = proc.communicate(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                text, _ = proc.communicate()
        out.write(text or "")
        info = _run([*base, "containers", "info", cid], check=False)
        if info.returncode != 0:
            raise RecordError(f"the container did not start (ctr run exit {proc.returncode}): {(text or '').strip()}")
        key = json.loads(info.stdout).get("SnapshotKey", cid)
        mounts = _run([*base, "snapshots", "--snapshotter", opts.snapshotter, "mounts", "/record-target",
                       str(key)]).stdout
        lowers = lowerdirs_of(mounts)
        lazy = {m.group("dir") for d in lowers if (m := _MOUNT_DIR.match(d))}
        local = sum(1 for d in lowers if not _MOUNT_DIR.match(d))
        if not lazy:
            raise RecordError(
                f"{opts.ref}: none of its layers is lazy, so no read can be recorded; convert it to eStargz, "
                "zstd:chunked or Nydus (snapshotter convert) and push it, and make sure the daemon runs as "
                f"containerd's snapshotter {opts.snapshotter!r}")
        if len(lazy) > 1:
            raise RecordError(f"the container's layers are served by several mount processes: {sorted(lazy)}")
        mount_dir = Path(next(iter(lazy)))
        if local:
            warnings.append(f"{local} of {len(lowers)} layers are not lazy; reads from them are not recorded")
        try:
            if (mount_dir / "state.json").stat().st_mtime < started - 1.0:
                warnings.append("the image's mount process was serving before this run: the record includes "
                                "earlier reads and misses reads served from the page cache")
        except OSError:
            pass
        doc = _ask_record(mount_dir)
        return RecordResult(paths=tuple(profile_paths(doc)), exit_status=None if timed_out else proc.returncode,
                            timed_out=timed_out, mount_dir=str(mount_dir), local_layers=local,
                            warnings=tuple(warnings))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _run([*base, "tasks", "delete", "-f", cid], timeout=30.0, check=False)
        _run([*base, "containers", "delete", cid], timeout=60.0, check=False)


def write_profile(paths: Sequence[str], output: Path | None) -> None:
    """One path per line to `output` (atomically) or stdout."""
    text = "".join(p + "\n" for p in paths)
    if output is None:
        sys.stdout.write(text)
        return
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, output)
