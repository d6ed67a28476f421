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
    ROOT/mounts/<mount id>/direct       hard links of the big files it stored whole in the cache, at
                                        their paths in the mount (fusefs/direct.py), for overlayfs
    ROOT/mounts/spare.log               stderr of the spare mount process until it is given a mount
    ROOT/mounts/preload/<key>           a layer's metadata bytes, handed to the spare to parse ahead
    ROOT/mounts/preload/<key>.<n>.index the index the spare parsed from them, when asked for it

Metadata image (remote/metaimages.py): the state file names where the mount's tree's metadata
image belongs ("meta_image"); the mount process writes it once quiet (or as it stops), unless it
exists. While the mount serves and the image exists, it is mounted at ROOT/mounts/<id>/meta
(checked when the mount starts and by `watch`), and `metadata_dir` names it: snapshots over the
image mounted from then on are overlay of META/<run> dirs over the FUSE mount as a data-only
layer. It is unmounted (lazily) when the mount stops; the image file stays for the next mount.
With `cache.direct_read_min_bytes`, the mount's direct directory is a data-only layer too, before
the FUSE mount (`direct_dir`): a big file the mount stored whole is read from disk by overlayfs.

The spare (config `spare_mount_process`): one mount process started ahead, imports done, that
waits on its stdin for a line {"state": STATE_FILE, "log": LOG_FILE, "auth": HANDOFF}; the next
mount hands it its state file instead of starting a process, and a new spare is started
SPARE_DELAY seconds later. "auth" (optional) is the daemon's registry authentication for the
image (challenges and pull tokens, fetch/auth.py `handoff`), so the mount's first requests carry
a token; it goes only over the pipe (a mount process started without the spare authenticates on
its own).
An unassigned spare exits when its stdin closes (the daemon stopped or died). An assigned one
changes its working directory to its mount's directory, which is how it is recognised later
(its command line names no state file).

Preloads (`preload`): while the daemon parses a lazy layer's metadata on a Prepare, the spare is
handed the same bytes (a file under ROOT/mounts/preload and a line {"preload": MetadataParse doc,
"data": PATH} on its stdin) and parses them on the other core; the state file names each layer's
parse key, and the spare, once handed a mount, uses the indexes it parsed instead of loading the
persisted ones. The daemon's Prepare and the mount's readiness no longer run one after the other
(fusefs/spare.py). Only an optimization: a preload that cannot be handed over is dropped.
A preload may also ask for an answer ("id", `want_answer`): the spare says on its reply pipe
whether the bytes parsed (remote/spare_replies.py), and the daemon then stores the bytes instead
of parsing them itself; without an answer the daemon parses, as before.

A mount process runs in its own session (not in the daemon's process group), so a daemon
restart or SIGKILL leaves it serving; the next daemon adopts it when its pid is alive, is a
mount process for that state file, and its mountpoint answers. A dead one leaves a stale FUSE
mount (ENOTCONN): it is lazily unmounted and the process started again.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from snapshotter import metrics
from snapshotter.config import Config
from snapshotter.errors import SnapshotterError
from snapshotter.formats.metadata_parse import NYDUS_BLOB, MetadataParse
from snapshotter.mountinfo import is_mountpoint
from snapshotter.remote.backend import RemoteLayer
from snapshotter.remote.metaimages import META_DIR, MetaImages, key_of
from snapshotter.remote.spare_replies import SpareReplies, SpareWait

log = logging.getLogger(__name__)

READY_TIMEOUT = 30.0
READY_FILE = "ready"  # written by the mount process once mounted and prefetched (fusefs/prefetch.py)
IN_USE_FILE = "in_use"  # made when a snapshot over the image asks for the mount (not by mount_on_pull)
RECORD_FILE = "record.json"  # its first-read record, on SIGUSR1 and at exit (`snapshotter record`)
STATS_FILE = "stats.json"
DIRECT_DIR = "direct"  # hard links of whole cached files, a data-only layer (fusefs/direct.py)
PROGRAMS_DIR = "programs"  # programs a new container will run, for the mount to fetch (fusefs/program_prefetch.py)
STOP_TIMEOUT = 5.0
SPARE_DELAY = 2.0  # seconds after a hand-off before the next spare starts (off the container's start path)
SPARE_LOG = "spare.log"
PRELOAD_DIR = "preload"
# Metadata larger than this is not preloaded: the spare would hold it while it waits.
PRELOAD_MAX_BYTES = 64 << 20
# Largest auth hand-off put on the spare's assignment line (a few bearer tokens are a few KiB; the
# line must fit in the pipe's buffer, which the spare's reader drains as lines come).
MAX_AUTH_HANDOFF = 16 << 10
WATCH_INTERVAL = 1.0  # seconds between checks of the mount processes' pids (`watch`)


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
    """"in_flight", "done" or "timeout" as the mount process's ready file says; "not_ready" without one."""
    try:
        return str(json.loads(ready_file.read_text()).get("prefetch", "unknown"))
    except (OSError, ValueError, AttributeError):
        return "not_ready"


def _final_stats(stats_file: Path) -> str:
    """" reads=.. read_bytes=.. demand_chunk_bytes=.. registry_bytes=.. direct_files=.. direct_bytes=..":
    the stopped mount's
    totals from its last stats file (it writes one as it stops), for the mount_stopped line."""
    try:
        doc = json.loads(stats_file.read_bytes())
        fuse, registry, direct = doc.get("fuse", {}), doc.get("registry", {}), doc.get("direct", {})
        values = {"reads": fuse.get("reads"), "read_bytes": fuse.get("read_bytes"),
                  "demand_chunk_bytes": fuse.get("demand_chunk_bytes"),
                  "registry_bytes": registry.get("bytes_received"),
                  "direct_files": direct.get("files"), "direct_bytes": direct.get("bytes")}
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
        self._spare_replies: SpareReplies | None = None  # the waiting spare's answers (spare_replies.py)
        self._spare_timer: threading.Timer | None = None
        self._spare_io = threading.Lock()  # one writer of the spare's stdin at a time (whole lines)
        self._closed = False
        self.preload_dir = self.dir / PRELOAD_DIR
        shutil.rmtree(self.preload_dir, ignore_errors=True)  # what an earlier daemon's spare never read
        self._meta_keys: dict[str, str] = {}  # mount id -> its metadata image's key (under _lock)
        self.meta = MetaImages(Path(config.root), enabled=config.metadata_image)

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
               ahead: bool = False, plain_http_hosts: Collection[str] = (),
               auth: Mapping[str, Any] | None = None) -> str:
        """The mountpoint of image `mount_id`, starting its mount process if it is not serving.
        ahead=True: mounted before any container asked (its background fetch waits until a
        later call without `ahead` marks it in use, or a read). plain_http_hosts: registry hosts
        the daemon found answering plain HTTP only, handed to a newly started mount process.
        auth: the daemon's registry authentication (`RegistryClient.auth_handoff`), handed to
        the spare with its assignment, over its stdin (it holds tokens: never in the state file)."""
        mnt, state, pidf, logf = self._paths(mount_id)
        in_use = self.dir / mount_id / IN_USE_FILE
        with self._lock:
            if self.alive(mount_id):
                if not ahead:
                    in_use.touch()
                self._attach_meta(mount_id)
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
                "programs_dir": str(self.dir / mount_id / PROGRAMS_DIR),
                # What the daemon learned: the mount's first read need not try TLS first.
                "plain_http_hosts": sorted(plain_http_hosts),
                "config": dataclasses.asdict(self.config),
                "runs": [[{"index": layer.index_path, "layer_digest": layer.layer_digest,
                           "parse_key": layer.parse_key,
                           "reader": {"kind": "registry", "image_ref": layer.image_ref,
                                      "layer_digest": layer.layer_digest, "blob_size": layer.blob_size,
                                      "format": layer.format}}
                          for layer in run] for run in runs],
            }
            if self.meta.available:
                key = self._meta_keys[mount_id] = key_of(doc)
                doc["meta_image"] = str(self.meta.image(key))  # the mount process writes it when quiet
                if self.config.cache.direct_read_min_bytes > 0:
                    direct = self.dir / mount_id / DIRECT_DIR
                    direct.mkdir(exist_ok=True)
                    doc["direct_dir"] = str(direct)
                    doc["direct_min_bytes"] = self.config.cache.direct_read_min_bytes
            tmp = state.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, state)
            pidf.unlink(missing_ok=True)
            in_use.unlink(missing_ok=True)
            if not ahead:
                in_use.touch()
            proc = self._launch(state, logf, auth)
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
                    self._attach_meta(mount_id)
                    return str(mnt)
                time.sleep(0.005)  # on a container's start path: poll finely (each check is a few stats)
            proc.kill()
            raise MountError(f"mount process for image mount {mount_id} not ready within {READY_TIMEOUT}s; "
                             f"see {logf}")

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "snapshotter.fusefs", *args, "--log-level", self.config.log_level,
                "--log-format", self.config.log_format]

    def _launch(self, state: Path, logf: Path, auth: Mapping[str, Any] | None = None) -> subprocess.Popen[bytes]:
        """A mount process for `state`: the spare, handed the state file (and `auth`, when it
        fits in MAX_AUTH_HANDOFF bytes), or a new process (which authenticates on its own)."""
        spare = self._take_spare()
        if spare is not None:
            assignment: dict[str, object] = {"state": str(state), "log": str(logf)}
            if auth and len(json.dumps(auth)) <= MAX_AUTH_HANDOFF:
                assignment["auth"] = dict(auth)
            try:
                assert spare.stdin is not None
                self._tell_spare(spare, assignment, last=True)
                self.schedule_spare()
                return spare
            except OSError as exc:  # it died after _take_spare looked, or does not read its stdin
                log.warning("event=spare_lost pid=%d error=%s; starting a mount process", spare.pid, exc)
                spare.kill()
                spare.wait(timeout=STOP_TIMEOUT)
        with open(logf, "ab") as log_out:
            proc = subprocess.Popen(self._command(str(state)), stdin=subprocess.DEVNULL, stdout=log_out,
                                    stderr=log_out, start_new_session=True, close_fds=True)
        self.schedule_spare()
        return proc

    def prefetch_program(self, mount_id: str, program: Mapping[str, Any]) -> bool:
        """Ask image `mount_id`'s mount process to fetch the program a container is about to run
        (runtime_spec.py `Program.to_doc`): a file in its programs dir, then SIGUSR2. Only a
        serving mount whose state names that dir (one started by a daemon that knows of it:
        SIGUSR2 would end an older one) is asked. True when asked."""
        pid = self._pid(mount_id)
        if pid is None:
            return False
        _mnt, state, _pidf, _logf = self._paths(mount_id)
        try:
            directory = json.loads(state.read_bytes()).get("programs_dir")
            if not isinstance(directory, str) or not _pid_is_mount_process(pid, state):
                return False
            os.makedirs(directory, exist_ok=True)
            name = f"{time.time_ns()}-{threading.get_ident()}"
            tmp = Path(directory) / f".{name}.tmp"
            tmp.write_text(json.dumps(program))
            os.replace(tmp, Path(directory) / f"{name}.json")
            os.kill(pid, signal.SIGUSR2)
        except (OSError, ValueError) as exc:  # ValueError: a state file that is not JSON
            log.info("event=program_request_failed mount=%s error=%s", mount_id, exc)
            return False
        return True

    # -- metadata images -------------------------------------------------------------------------

    def metadata_dir(self, mount_id: str) -> str | None:
        """Where image `mount_id`'s metadata image is mounted (its runs are META/<run>), or None
        while there is none (not built yet, turned off, or this kernel cannot stack it)."""
        meta = self.dir / mount_id / META_DIR
        return str(meta) if self.meta.available and is_mountpoint(meta) else None

    def direct_dir(self, mount_id: str) -> str | None:
        """Image `mount_id`'s direct directory (fusefs/direct.py), a data-only layer to list
        before the FUSE mount under its metadata image's runs; None when it has none."""
        if not self.meta.available or self.config.cache.direct_read_min_bytes <= 0:
            return None
        direct = self.dir / mount_id / DIRECT_DIR
        return str(direct) if direct.is_dir() else None

    def _meta_key(self, mount_id: str) -> str | None:
        """The metadata image key of serving mount `mount_id` (from its state file after a daemon restart)."""
        key = self._meta_keys.get(mount_id)
        if key is None:
            try:
                key = self._meta_keys[mount_id] = key_of(json.loads(self._paths(mount_id)[1].read_bytes()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("event=meta_key_failed mount=%s error=%r", mount_id, exc)
                return None
        return key

    def _attach_meta(self, mount_id: str) -> None:
        """Under _lock, for a serving mount: mount its metadata image next to it if it exists."""
        meta = self.dir / mount_id / META_DIR
        if not self.meta.available or is_mountpoint(meta):
            return
        key = self._meta_key(mount_id)
        if key is not None and self.meta.attach(key, meta):
            log.info("event=meta_mounted mount=%s key=%s", mount_id, key)

    def prune_metadata_images(self) -> list[str]:
        """Remove metadata images whose layer indexes are gone (garbage collection)."""
        return self.meta.prune()

    # -- the spare ---------------------------------------------------------------------------------

    def _tell_spare(self, spare: subprocess.Popen[bytes], doc: dict[str, object], *, last: bool = False) -> None:
        """Write one line to the spare's stdin without ever blocking (a line is far shorter than
        the pipe's buffer; a spare that lets the buffer fill is not reading: OSError), and with
        `last` close it. OSError also when it was closed already."""
        line = json.dumps(doc).encode() + b"\n"
        assert spare.stdin is not None
        with self._spare_io:
            if spare.stdin.closed:
                raise OSError(errno.EPIPE, "the spare was handed a mount already")
            fd = spare.stdin.fileno()
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
            try:
                written = os.write(fd, line)  # a pipe writes a line under PIPE_BUF whole or not at all
                if written != len(line):
                    raise OSError(errno.EAGAIN, f"the spare took {written} of {len(line)} bytes")
            finally:
                if last:
                    spare.stdin.close()

    def preload(self, parse: MetadataParse, data: bytes, key: str, image_layers: tuple[str, ...] = (), *,
                want_answer: bool = False, early: Mapping[str, Any] | None = None) -> SpareWait | None:
        """Hand the waiting spare a layer's metadata to parse while the daemon parses it too (see
        the module docstring); key: `parse.key(data)`; image_layers: for an image's lowest layer, the image's layers
        (the spare builds the image's tree once it has them all), else empty. Never blocks, never raises: without a
        spare, or on any failure, the preload is dropped and the mount loads the persisted index.
        want_answer: ask the spare to say whether the bytes parsed; returned is then the wait for that
        answer (None: not asked, because there is nothing to parse or no spare took it).
        early: the layer's "early" object (remote/backend.py `early_object`), sent along with
        `mount_on_pull` and when its auth hand-off fits in MAX_AUTH_HANDOFF bytes."""
        if not self.config.preload_metadata:
            return None
        with self._spare_lock:
            spare, replies = self._spare, self._spare_replies
        if spare is None or spare.poll() is not None or len(data) > PRELOAD_MAX_BYTES:
            return None
        path = self.preload_dir / key
        doc: dict[str, object] = {"preload": parse.to_doc(), "data": str(path), "layers": list(image_layers)}
        if early is not None and self.config.mount_on_pull and \
                len(json.dumps(early.get("auth") or {})) <= MAX_AUTH_HANDOFF:
            doc["early"] = early
        answer_id: int | None = None
        if want_answer and replies is not None and not replies.closed and parse.kind != NYDUS_BLOB:
            answer_id = replies.new_id()
            doc["id"] = answer_id
        try:
            self.preload_dir.mkdir(exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)  # not synced: it lives until the spare reads it, seconds at most
            os.replace(tmp, path)
            self._tell_spare(spare, doc)
        except (OSError, ValueError) as exc:  # ValueError: its stdin closed under us (handed a mount)
            path.unlink(missing_ok=True)
            log.debug("event=preload_dropped layer=%s error=%s", parse.layer_digest, exc)
            return None
        log.debug("event=preload layer=%s bytes=%d spare=%d", parse.layer_digest, len(data), spare.pid)
        if answer_id is None or replies is None:
            return None
        return functools.partial(replies.wait, answer_id)

    def _take_spare(self) -> subprocess.Popen[bytes] | None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
            self._spare_replies = None  # its waits go on: the spare answers them or closes the pipe
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
                reply_read, reply_write = os.pipe()
            except OSError as exc:
                log.warning("event=spare_failed error=%s; mounts start their own process", exc)
                return
            try:
                with open(self.dir / SPARE_LOG, "ab") as log_out:
                    self._spare = subprocess.Popen(self._command("--spare", "--reply-fd", str(reply_write)),
                                                   stdin=subprocess.PIPE, stdout=log_out, stderr=log_out,
                                                   start_new_session=True, close_fds=True, pass_fds=(reply_write,),
                                                   cwd=self.dir)
            except OSError as exc:
                os.close(reply_read)
                log.warning("event=spare_failed error=%s; mounts start their own process", exc)
                return
            finally:
                os.close(reply_write)
            self._spare_replies = SpareReplies(reply_read, self._spare.pid)
        log.debug("event=spare_started pid=%d", self._spare.pid)

    def close(self) -> None:
        """Stop the spare (closing its stdin ends it); mount processes (and their metadata images)
        are left serving."""
        with self._spare_lock:
            self._closed = True
            if self._spare_timer is not None:
                self._spare_timer.cancel()
            spare, self._spare = self._spare, None
            self._spare_replies = None
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
        self.meta.detach(self.dir / mount_id / META_DIR)
        self._meta_keys.pop(mount_id, None)
        lazy_unmount(mnt)
        pidf.unlink(missing_ok=True)
        totals = _final_stats(self.dir / mount_id / STATS_FILE) if pid is not None or child is not None else ""
        if remove and not is_mountpoint(mnt):
            shutil.rmtree(self.dir / mount_id, ignore_errors=True)
        if pid is not None or child is not None:
            log.info("event=mount_stopped mount=%s pid=%s%s", mount_id, pid, totals)

    def watch(self, stop: threading.Event, interval: float = WATCH_INTERVAL) -> None:
        """Until `stop` is set: report each mount process that died (WARN `event=mount_died`, once
        per process), and mount a serving mount's metadata image once its process wrote it. Only
        pids are checked, never a mountpoint (a hung process would block the stat); the image's
        next Prepare/Mounts replaces the process (`ensure`)."""
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
                        else:  # serving: its metadata image may have been written since
                            self._attach_meta(mount_id)
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
