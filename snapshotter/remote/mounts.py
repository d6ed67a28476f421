"""Per-image mount processes: start, find again after a daemon restart, stop.

    ROOT/mounts/<mount id>/state.json   what the mount process serves (written before it starts)
    ROOT/mounts/<mount id>/mnt          its FUSE mountpoint; run N of the image is mnt/N
    ROOT/mounts/<mount id>/pid          the mount process's pid, once it is ready
    ROOT/mounts/<mount id>/log          its stderr
    ROOT/mounts/<mount id>/ready        written by it once mounted and prefetched (or prefetch_timeout)
    ROOT/mounts/<mount id>/record.json  its first-read record, written on SIGUSR1 (`snapshotter record`)
    ROOT/mounts/<mount id>/stats.json   its counters, rewritten every second (fusefs/stats.py)
    ROOT/mounts/<mount id>/in_use       made once a snapshot over the image asked for the mount; a
                                        mount started on pull fetches in background only after it
    ROOT/mounts/<mount id>/meta         the mount's metadata image, mounted (config `metadata_image`)
    ROOT/mounts/<mount id>/meta.erofs   that image; meta.log: its builder's stderr
    ROOT/mounts/spare.log               stderr of the spare mount process until it is given a mount

Metadata image (fusefs/metamount.py): META_DELAY seconds after a mount first serves (off its first
container's start path), a niced builder process writes the image of the mount's tree and mounts
it at ROOT/mounts/<id>/meta. From then on `metadata_dir` names it, and snapshots over the image
are mounted as overlay of META/<run> dirs over the FUSE mount as a data-only layer. A builder
that finds the kernel unable to stack it (exit 3) turns the feature off for this daemon.

The spare (config `spare_mount_process`): one mount process started ahead, imports done, that
waits on its stdin for a line {"state": STATE_FILE, "log": LOG_FILE}; the next mount hands it its
state file instead of starting a process, and a new spare is started SPARE_DELAY seconds later.
An unassigned spare exits when its stdin closes (the daemon stopped or died). An assigned one
changes its working directory to its mount's directory, which is how it is recognised later
(its command line names no state file).

A mount process runs in its own session (not in the daemon's process group), so a daemon
restart or SIGKILL leaves it serving; the next daemon adopts it when its pid is alive, is a
mount process for that state file, and its mountpoint answers. A dead one leaves a stale FUSE
mount (ENOTCONN): it is lazily unmounted and the process started again.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path

from snapshotter import metrics
from snapshotter.config import Config
from snapshotter.errors import SnapshotterError
from snapshotter.fusefs.metamount import EXIT_UNSUPPORTED
from snapshotter.fusefs.metamount import unmount as unmount_meta
from snapshotter.mountinfo import is_mountpoint
from snapshotter.remote.backend import RemoteLayer

log = logging.getLogger(__name__)

READY_TIMEOUT = 30.0
READY_FILE = "ready"  # written by the mount process once mounted and prefetched (fusefs/prefetch.py)
IN_USE_FILE = "in_use"  # made when a snapshot over the image asks for the mount (not by mount_on_pull)
RECORD_FILE = "record.json"  # its first-read record, on SIGUSR1 and at exit (`snapshotter record`)
STATS_FILE = "stats.json"
STOP_TIMEOUT = 5.0
SPARE_DELAY = 2.0  # seconds after a hand-off before the next spare starts (off the container's start path)
SPARE_LOG = "spare.log"
WATCH_INTERVAL = 1.0  # seconds between checks of the mount processes' pids (`watch`)
META_DIR = "meta"
META_LOG = "meta.log"
META_DELAY = 1.0  # seconds after a mount serves before its metadata image is built (off the start path)


class MountError(SnapshotterError):
    """A mount process could not be started or did not become ready."""


def _answers(path: Path) -> bool:
    try:
        os.stat(path)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO):
            return False
        raise


def _pid_is_mount_process(pid: int, state: Path) -> bool:
    """True when `pid` is the mount process serving `state` (started with it, or a spare that
    was handed it and moved into its directory)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"snapshotter.fusefs" not in cmdline:
            return False
        if os.fsencode(state) in cmdline:
            return True
        return b"--spare" in cmdline and os.readlink(f"/proc/{pid}/cwd") == os.path.abspath(state.parent)
    except OSError:
        return False


def lazy_unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        if not is_mountpoint(path):
            return
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)


def _prefetch_outcome(ready_file: Path) -> str:
    """"done" or "timeout" as the mount process's ready file says; "not_ready" without one."""
    try:
        return str(json.loads(ready_file.read_text()).get("prefetch", "unknown"))
    except (OSError, ValueError, AttributeError):
        return "not_ready"


def _final_stats(stats_file: Path) -> str:
    """" reads=.. read_bytes=.. demand_chunk_bytes=.. registry_bytes=..": the stopped mount's
    totals from its last stats file (it writes one as it stops), for the mount_stopped line."""
    try:
        doc = json.loads(stats_file.read_bytes())
        fuse, registry = doc.get("fuse", {}), doc.get("registry", {})
        values = {"reads": fuse.get("reads"), "read_bytes": fuse.get("read_bytes"),
                  "demand_chunk_bytes": fuse.get("demand_chunk_bytes"),
                  "registry_bytes": registry.get("bytes_received")}
    except (OSError, ValueError, AttributeError):
        return ""
    return "".join(f" {k}={int(v)}" for k, v in values.items() if isinstance(v, int))


class MountManager:
    """Implements remote.backend.Mounter. Thread-safe."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.dir = Path(config.root) / "mounts"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._reported_dead: set[tuple[str, int]] = set()
        self._spare_lock = threading.Lock()  # guards the three below; never held while waiting on a mount
        self._spare: subprocess.Popen[bytes] | None = None
        self._spare_timer: threading.Timer | None = None
        self._closed = False
        self._meta_lock = threading.Lock()  # guards the three below; never held while waiting on a process
        self._meta_builders: dict[str, subprocess.Popen[bytes]] = {}
        self._meta_timers: dict[str, threading.Timer] = {}
        self._meta_unsupported = not config.metadata_image

    def _paths(self, mount_id: str) -> tuple[Path, Path, Path, Path]:
        if not mount_id.isdigit():
            raise MountError(f"bad mount id {mount_id!r}")
        d = self.dir / mount_id
        return d / "mnt", d / "state.json", d / "pid", d / "log"

    def _pid(self, mount_id: str) -> int | None:
        try:
            return int(self._paths(mount_id)[2].read_text())
        except (FileNotFoundError, ValueError):
            return None

    def alive(self, mount_id: str) -> bool:
        mnt, state, _pidf, _log = self._paths(mount_id)
        pid = self._pid(mount_id)
        return (pid is not None and _pid_is_mount_process(pid, state) and is_mountpoint(mnt)
                and _answers(mnt))

    def mounted_ids(self) -> set[str]:
        return {p.name for p in self.dir.iterdir() if p.is_dir() and p.name.isdigit()}

    def pids(self) -> dict[str, int | None]:
        return {m: self._pid(m) for m in sorted(self.mounted_ids())}

    def ensure(self, mount_id: str, runs: list[list[RemoteLayer]], *, bare_runs: tuple[int, ...] = (),
               ahead: bool = False, plain_http_hosts: Collection[str] = ()) -> str:
        """The mountpoint of image `mount_id`, starting its mount process if it is not serving.
        ahead=True: mounted before any container asked (its background fetch waits until a
        later call without `ahead` marks it in use, or a read). plain_http_hosts: registry hosts
        the daemon found answering plain HTTP only, handed to a newly started mount process."""
        mnt, state, pidf, logf = self._paths(mount_id)
        in_use = self.dir / mount_id / IN_USE_FILE
        with self._lock:
            if self.alive(mount_id):
                if not ahead:
                    in_use.touch()
                self._schedule_meta(mount_id)
                return str(mnt)
            dead_pid = self._pid(mount_id)
            if dead_pid is not None and (mount_id, dead_pid) not in self._reported_dead:
                # It was serving (its pid file is written once ready): it died or its mount broke.
                log.warning("event=mount_died mount=%s pid=%d process_alive=%s; starting it again",
                            mount_id, dead_pid, _pid_is_mount_process(dead_pid, state))
            self._stop_locked(mount_id, remove=False)
            mnt.mkdir(parents=True, exist_ok=True)
            doc = {
                "mountpoint": str(mnt),
                "stats_file": str(self.dir / mount_id / STATS_FILE),
                "ready_file": str(self.dir / mount_id / READY_FILE),
                "record_file": str(self.dir / mount_id / RECORD_FILE),
                "prefetch_timeout": self.config.prefetch_timeout,
                "fetch_timeout": self.config.fetch_timeout,
                "bare_runs": list(bare_runs),
                "in_use_file": str(in_use),
                # What the daemon learned: the mount's first read need not try TLS first.
                "plain_http_hosts": sorted(plain_http_hosts),
                "config": dataclasses.asdict(self.config),
                "runs": [[{"index": layer.index_path, "layer_digest": layer.layer_digest,
                           "reader": {"kind": "registry", "image_ref": layer.image_ref,
                                      "layer_digest": layer.layer_digest, "blob_size": layer.blob_size,
                                      "format": layer.format}}
                          for layer in run] for run in runs],
            }
            tmp = state.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, state)
            pidf.unlink(missing_ok=True)
            in_use.unlink(missing_ok=True)
            if not ahead:
                in_use.touch()
            proc = self._launch(state, logf)
            self._children[mount_id] = proc
            readyf = self.dir / mount_id / READY_FILE
            deadline = time.monotonic() + READY_TIMEOUT
            prefetch_deadline: float | None = None
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise MountError(f"mount process for image mount {mount_id} exited with {proc.returncode}; "
                                     f"see {logf}")
                if prefetch_deadline is None and is_mountpoint(mnt) and _answers(mnt):
                    # Mounted; container start now waits for the landmark prefetch, at most
                    # prefetch_timeout (the process writes its ready file by then; the grace
                    # covers a slow process, the mount serves reads either way).
                    prefetch_deadline = time.monotonic() + self.config.prefetch_timeout + 2.0
                    deadline = max(deadline, prefetch_deadline + 1.0)
                if prefetch_deadline is not None and (readyf.exists() or time.monotonic() > prefetch_deadline):
                    pidf.write_text(str(proc.pid))
                    metrics.MOUNTS_ALIVE.set(len(self.mounted_ids()))
                    log.info("event=mount_started mount=%s pid=%d runs=%d layers=%d prefetch=%s", mount_id,
                             proc.pid, len(runs), sum(len(r) for r in runs), _prefetch_outcome(readyf))
                    self._schedule_meta(mount_id)
                    return str(mnt)
                time.sleep(0.005)  # on a container's start path: poll finely (each check is a few stats)
            proc.kill()
            raise MountError(f"mount process for image mount {mount_id} not ready within {READY_TIMEOUT}s; "
                             f"see {logf}")

    def _command(self, *args: str) -> list[str]:
        return self._command_of("snapshotter.fusefs", *args)

    def _command_of(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args, "--log-level", self.config.log_level,
                "--log-format", self.config.log_format]

    def _launch(self, state: Path, logf: Path) -> subprocess.Popen[bytes]:
        """A mount process for `state`: the spare, handed the state file, or a new process."""
        spare = self._take_spare()
        if spare is not None:
            try:
                assert spare.stdin is not None
                spare.stdin.write(json.dumps({"state": str(state), "log": str(logf)}).encode() + b"\n")
                spare.stdin.close()
                self.schedule_spare()
                return spare
            except OSError as exc:  # it died after _take_spare looked
                log.warning("event=spare_lost pid=%d error=%s; starting a mount process", spare.pid, exc)
                spare.kill()
                spare.wait(timeout=STOP_TIMEOUT)
        with open(logf, "ab") as log_out:
            proc = subprocess.Popen(self._command(str(state)), stdin=subprocess.DEVNULL, stdout=log_out,
                                    stderr=log_out, start_new_session=True, close_fds=True)
        self.schedule_spare()
        return proc

    # -- metadata images -------------------------------------------------------------------------

    def metadata_dir(self, mount_id: str) -> str | None:
        """Where image `mount_id`'s metadata image is mounted (its runs are META/<run>), or None
        while there is none (not built yet, turned off, or this kernel cannot stack it)."""
        meta = self.dir / mount_id / META_DIR
        return str(meta) if not self._meta_unsupported and is_mountpoint(meta) else None

    def _schedule_meta(self, mount_id: str, delay: float = META_DELAY) -> None:
        """Build and mount the metadata image of serving mount `mount_id` after `delay` seconds,
        unless it is mounted, being built, or the feature is off."""
        with self._meta_lock:
            if self._meta_unsupported or self._closed or mount_id in self._meta_timers:
                return
            builder = self._meta_builders.get(mount_id)
            if builder is not None and builder.poll() is None:
                return
            if is_mountpoint(self.dir / mount_id / META_DIR):
                return
            timer = threading.Timer(delay, self._start_meta, args=(mount_id,))
            timer.daemon = True
            self._meta_timers[mount_id] = timer
            timer.start()

    def _start_meta(self, mount_id: str) -> None:
        state = self.dir / mount_id / "state.json"
        with self._meta_lock:
            self._meta_timers.pop(mount_id, None)
            if self._closed or self._meta_unsupported or not state.exists():
                return
            command = ["nice", "-n", "19", *self._command_of("snapshotter.fusefs.metamount", str(state),
                                                              str(self.dir / mount_id / META_DIR))]
            try:
                with open(self.dir / mount_id / META_LOG, "ab") as log_out:
                    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_out, stderr=log_out,
                                            start_new_session=True, close_fds=True)
            except OSError as exc:
                log.warning("event=meta_failed mount=%s error=%s; its containers keep FUSE for metadata", mount_id, exc)
                return
            self._meta_builders[mount_id] = proc
        threading.Thread(target=self._reap_meta, args=(mount_id, proc), daemon=True,
                         name=f"meta-{mount_id}").start()

    def _reap_meta(self, mount_id: str, proc: subprocess.Popen[bytes]) -> None:
        status = proc.wait()
        with self._meta_lock:
            if self._meta_builders.get(mount_id) is proc:
                del self._meta_builders[mount_id]
        if status == 0:
            log.info("event=meta_mounted mount=%s", mount_id)
        elif status == EXIT_UNSUPPORTED:
            self._meta_unsupported = True
            log.warning("event=meta_unsupported mount=%s; containers keep the FUSE mount for metadata (see %s)",
                        mount_id, self.dir / mount_id / META_LOG)
        elif status > 0:  # < 0: stopped by _stop_meta
            log.warning("event=meta_failed mount=%s status=%d; see %s", mount_id, status,
                        self.dir / mount_id / META_LOG)

    def _stop_meta(self, mount_id: str) -> None:
        """Stop the image's metadata builder and unmount its image (lazily: containers using it keep it)."""
        with self._meta_lock:
            timer = self._meta_timers.pop(mount_id, None)
            builder = self._meta_builders.pop(mount_id, None)
        if timer is not None:
            timer.cancel()
        if builder is not None and builder.poll() is None:
            builder.kill()
            builder.wait(timeout=STOP_TIMEOUT)
        unmount_meta(self.dir / mount_id / META_DIR)

    # -- the spare ---------------------------------------------------------------------------------

    def _take_spare(self) -> subprocess.Popen[bytes] | None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.poll() is not None:
            log.warning("event=spare_died pid=%d status=%s; see %s", spare.pid, spare.returncode,
                        self.dir / SPARE_LOG)
            return None
        return spare

    def schedule_spare(self, delay: float = SPARE_DELAY) -> None:
        """Start a spare mount process after `delay` seconds, unless one is waiting (or the
        config turns spares off, or `close` was called)."""
        if not self.config.spare_mount_process:
            return
        with self._spare_lock:
            if self._closed or (self._spare_timer is not None and self._spare_timer.is_alive()):
                return
            self._spare_timer = threading.Timer(delay, self._start_spare)
            self._spare_timer.daemon = True
            self._spare_timer.start()

    def _start_spare(self) -> None:
        with self._spare_lock:
            if self._closed or (self._spare is not None and self._spare.poll() is None):
                return
            try:
                with open(self.dir / SPARE_LOG, "ab") as log_out:
                    self._spare = subprocess.Popen(self._command("--spare"), stdin=subprocess.PIPE, stdout=log_out,
                                                   stderr=log_out, start_new_session=True, close_fds=True,
                                                   cwd=self.dir)
            except OSError as exc:
                log.warning("event=spare_failed error=%s; mounts start their own process", exc)
                return
        log.debug("event=spare_started pid=%d", self._spare.pid)

    def close(self) -> None:
        """Stop the spare (closing its stdin ends it) and pending metadata builds; mount processes
        (and metadata images already mounted) are left serving."""
        with self._meta_lock:
            self._closed = True
            timers = list(self._meta_timers.values())
            self._meta_timers.clear()
        for timer in timers:
            timer.cancel()
        with self._spare_lock:
            self._closed = True
            if self._spare_timer is not None:
                self._spare_timer.cancel()
            spare, self._spare = self._spare, None
        if spare is not None:
            if spare.stdin is not None:
                spare.stdin.close()
            try:
                spare.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                spare.kill()
                spare.wait(timeout=STOP_TIMEOUT)

    def release(self, mount_id: str) -> None:
        """Stop image `mount_id`'s mount process and remove its directory."""
        log.info("event=mount_release mount=%s reason=unused", mount_id)
        with self._lock:
            self._stop_locked(mount_id, remove=True)
        metrics.MOUNTS_ALIVE.set(len(self.mounted_ids()))

    def _stop_locked(self, mount_id: str, *, remove: bool) -> None:
        mnt, state, pidf, _log = self._paths(mount_id)
        pid = self._pid(mount_id)
        child = self._children.pop(mount_id, None)
        if pid is not None and _pid_is_mount_process(pid, state):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + STOP_TIMEOUT
            while time.monotonic() < deadline and _pid_is_mount_process(pid, state):
                if child is not None and child.poll() is not None:
                    break
                time.sleep(0.02)
            if _pid_is_mount_process(pid, state):
                os.kill(pid, signal.SIGKILL)
        if child is not None:
            try:
                child.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                child.kill()
        self._stop_meta(mount_id)
        lazy_unmount(mnt)
        pidf.unlink(missing_ok=True)
        totals = _final_stats(self.dir / mount_id / STATS_FILE) if pid is not None or child is not None else ""
        if remove and not is_mountpoint(mnt):
            shutil.rmtree(self.dir / mount_id, ignore_errors=True)
        if pid is not None or child is not None:
            log.info("event=mount_stopped mount=%s pid=%s%s", mount_id, pid, totals)

    def watch(self, stop: threading.Event, interval: float = WATCH_INTERVAL) -> None:
        """Until `stop` is set: report each mount process that died (WARN `event=mount_died`, once
        per process). Only pids are checked, never a mountpoint (a hung process would block the
        stat); the image's next Prepare/Mounts replaces the process (`ensure`)."""
        while not stop.wait(interval):
            try:
                for mount_id in sorted(self.mounted_ids()):
                    with self._lock:  # not while ensure/release start or stop it
                        pid = self._pid(mount_id)
                        if pid is None or (mount_id, pid) in self._reported_dead:
                            continue
                        if not _pid_is_mount_process(pid, self._paths(mount_id)[1]):
                            self._reported_dead.add((mount_id, pid))
                            log.warning("event=mount_died mount=%s pid=%d detected_by=watch; the image's "
                                        "next container start replaces it", mount_id, pid)
            except Exception:  # the watcher must outlive a surprise (a dir removed meanwhile...)
                log.exception("event=mount_watch_failed")

    def adopt(self) -> tuple[list[str], list[str]]:
        """At daemon start: keep live mount processes, clear stale mounts of dead ones.

        Returns (adopted ids, cleared ids). A cleared image is mounted again on its next use
        (Prepare/Mounts), from the persisted state, without blocking start-up.
        """
        adopted, cleared = [], []
        with self._lock:
            for mount_id in sorted(self.mounted_ids()):
                if self.alive(mount_id):
                    adopted.append(mount_id)
                    log.info("event=mount_adopted mount=%s pid=%s", mount_id, self._pid(mount_id))
                else:
                    self._stop_locked(mount_id, remove=False)
                    cleared.append(mount_id)
        metrics.MOUNTS_ALIVE.set(len(adopted))
        return adopted, cleared
