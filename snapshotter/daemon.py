"""The daemon: wires config, the snapshotter and the gRPC server, and runs until a signal.

Socket rules: the socket's directory is created 0700, the socket is 0660, a stale socket left by
a dead daemon is replaced, and a socket a live daemon still answers on is left alone (start-up
fails with a message naming it). SIGTERM and SIGINT stop the server gracefully.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import start_http_server

from snapshotter import metrics
from snapshotter.admin import AdminServer
from snapshotter.cache import ChunkCache
from snapshotter.config import Config
from snapshotter.errors import SnapshotterError
from snapshotter.grpcapi import SnapshotsServicer, add_to_server
from snapshotter.remote.backend import RemoteBackend
from snapshotter.remote.container_watch import ContainerWatch
from snapshotter.remote.mounts import MountManager
from snapshotter.remote.mountstats import MountStatsCollector
from snapshotter.snapshots.service import Snapshotter
from snapshotter.status import admin_socket_path, build_status

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0


class StartupError(SnapshotterError):
    """The daemon cannot start (socket in use, root unusable)."""


def _socket_is_live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def prepare_socket_path(path: Path) -> None:
    """Create the socket's directory (0700) and remove a stale socket; refuse a live one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; remove it or choose another --address")
    if _socket_is_live(path):
        raise StartupError(f"another process is serving {path}; stop it or choose another --address")
    os.unlink(path)
    log.info("event=stale_socket_removed path=%s", path)


def repair_cache(cache_dir: Path, max_bytes: int) -> None:
    """Reconcile the chunk cache with its index after a crash (temp files of dead writers, files
    without rows, rows without files). Runs once at start, off the start-up path."""
    if not cache_dir.exists():
        return
    try:
        cache = ChunkCache(cache_dir, max_bytes)
        try:
            report = cache.repair()
        finally:
            cache.close()
    except Exception as exc:  # a broken cache must not stop the daemon; reads refetch
        log.warning("event=cache_repair_failed dir=%s error=%r", cache_dir, str(exc))
        return
    log.info("event=cache_repair temp_files=%d orphan_files=%d missing_files=%d", report.temp_files,
             report.orphan_files, report.missing_files)


def notify_systemd(message: str) -> None:
    """sd_notify(3) without libsystemd: a datagram to $NOTIFY_SOCKET, if set."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(message.encode(), target)
        except OSError as exc:
            log.warning("event=sd_notify_failed error=%s", exc)


@dataclass
class Daemon:
    """A running daemon: call `start()`, then `wait()` or `stop()`."""

    config: Config
    server: grpc.Server | None = None
    snapshotter: Snapshotter | None = None
    mounter: MountManager | None = None
    backend: RemoteBackend | None = None
    admin: AdminServer | None = None
    _owns_socket: bool = False
    _metrics_server: Any = None
    _collector: MountStatsCollector | None = None
    _cache: ChunkCache | None = None
    _cache_lock: threading.Lock = field(default_factory=threading.Lock)
    _watch_stop: threading.Event = field(default_factory=threading.Event)
    _containers: ContainerWatch | None = None

    def cache_usage(self) -> tuple[int, int]:
        """(bytes, chunks) in the chunk cache the mount processes share (opened on first use)."""
        with self._cache_lock:
            if self._cache is None:
                self._cache = ChunkCache(Path(self.config.root) / "cache", self.config.cache.max_bytes)
            usage = self._cache.usage()
        return usage.bytes, usage.chunks

    def status(self) -> dict[str, Any]:
        """The `snapshotter status` document (snapshotter/status.py)."""
        assert self.snapshotter is not None and self.mounter is not None and self.backend is not None
        mounter = self.mounter
        return build_status(list(self.snapshotter.walk([])), self.backend.layers, mounter.dir, mounter.alive,
                            mounter.pids(), self.cache_usage, self.config.cache.max_bytes,
                            {"pid": os.getpid(), "root": self.config.root, "address": self.config.address})

    def start(self) -> None:
        root = Path(self.config.root)
        address = Path(self.config.address)
        prepare_socket_path(address)
        root.mkdir(parents=True, exist_ok=True)
        self.snapshotter = Snapshotter(root)
        self.mounter = MountManager(self.config)
        backend = self.backend = RemoteBackend(self.snapshotter, self.config, self.mounter)
        backend.resolve_loop.start_in_background()
        # Adopt surviving mount processes (and clear stale mounts) off the start-up path.
        threading.Thread(target=self.mounter.adopt, name="adopt-mounts", daemon=True).start()
        self.mounter.schedule_spare(delay=0.0)
        threading.Thread(target=repair_cache, args=(root / "cache", self.config.cache.max_bytes),
                         name="repair-cache", daemon=True).start()
        # Report mount processes that die (they are replaced on their image's next use).
        self._watch_stop.clear()
        threading.Thread(target=self.mounter.watch, args=(self._watch_stop,), name="watch-mounts",
                         daemon=True).start()
        if self.config.containerd_address and self.config.prefetch.program:
            self._containers = ContainerWatch(self.config.containerd_address, backend.container_created)
            self._containers.start()
        if self.config.metrics_address:
            host, _, port = self.config.metrics_address.rpartition(":")
            self._collector = MountStatsCollector(self.mounter.dir, self.cache_usage)
            metrics.REGISTRY.register(self._collector)
            self._metrics_server, _thread = start_http_server(int(port), addr=host or "127.0.0.1",
                                                              registry=metrics.REGISTRY)
            log.info("event=metrics_serving address=%s", self.config.metrics_address)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc"),
                                  options=[("grpc.max_receive_message_length", 16 << 20)])
        add_to_server(SnapshotsServicer(backend, observe=metrics.observe_grpc), self.server)
        old_umask = os.umask(0o117)
        try:
            if self.server.add_insecure_port(f"unix://{address}") == 0:
                raise StartupError(f"cannot listen on {address}")
            self.server.start()
        finally:
            os.umask(old_umask)
        self._owns_socket = True
        os.chmod(address, 0o660)
        self.admin = AdminServer(admin_socket_path(address), self.status)
        self.admin.start()
        log.info("event=serving address=%s root=%s pid=%d", address, root, os.getpid())
        notify_systemd("READY=1")

    def stop(self) -> None:
        notify_systemd("STOPPING=1")
        self._watch_stop.set()
        if self._containers is not None:
            self._containers.close()
            self._containers = None
        if self.mounter is not None:
            self.mounter.close()
        if self.backend is not None:
            self.backend.close()
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        if self.server is not None:
            self.server.stop(GRACE_SECONDS).wait(GRACE_SECONDS + 1)
            self.server = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if self._collector is not None:
            metrics.REGISTRY.unregister(self._collector)
            self._collector = None
        if self.snapshotter is not None:
            self.snapshotter.close()
            self.snapshotter = None
        with self._cache_lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None
        if self._owns_socket:  # never remove a socket another daemon serves
            self._owns_socket = False
            try:
                if stat.S_ISSOCK(os.lstat(self.config.address).st_mode):
                    os.unlink(self.config.address)
            except FileNotFoundError:
                pass
        log.info("event=stopped")


def run(config: Config) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code."""
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon = Daemon(config)
    try:
        daemon.start()
        # Short waits: the kernel hands a process signal to any thread that does not block it,
        # and Python runs the handler in the main thread only once that thread runs Python code
        # again. A wait of an hour could ignore a `systemctl stop` (then SIGKILL) that long.
        while not stop.wait(0.5):
            pass
        log.info("event=signal signal=%s", signal.Signals(received[0]).name if received else "?")
    finally:
        daemon.stop()
    return 0
