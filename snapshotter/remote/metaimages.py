"""The daemon's metadata images: built once per tree in the background, kept, mounted next to mounts.

    ROOT/metaimages/<key>.erofs          a metadata image (fusefs/metaimage.py)
    ROOT/metaimages/<key>.sources.json   the layer index files it was built from
    ROOT/metaimages/<key>.log            its builder's stderr

The key is a digest of what the mount's tree is made of (each run's layer digests and index files,
their sizes and mtimes, the bare runs, the image format's version), so the same image pulled again,
or its mount stopped and started again, finds its metadata image already built: a mount process
stopped with its last container (remote/mounts.py) does not take the image with it, and the next
container of the image gets it at once. An image whose index files are gone is removed by `prune`
(on the daemon's garbage collection).

`build` starts at most one builder per key (`nice -n 19 python -m snapshotter.fusefs.metamount`);
when it ends, `on_built(key)` is called from its reaper thread. A key whose builder failed is not
built again by this daemon (a mount's every Mounts call would start it again). A builder that finds the kernel
unable to stack metadata images (exit 3) turns them off for this daemon (`available` is False).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from snapshotter.fusefs.metamount import EXIT_UNSUPPORTED, mount_erofs, sources_path
from snapshotter.fusefs.metamount import unmount as unmount_meta
from snapshotter.mountinfo import is_mountpoint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when build_meta_image's output for the same tree changes
SUFFIX = ".erofs"


def key_of(state: Mapping[str, Any]) -> str:
    """The metadata image key of a mount state document (remote/mounts.py writes it)."""
    runs = []
    for run in state.get("runs", []):
        layers = []
        for layer in run:
            index = str(layer["index"])
            try:
                st = os.stat(index)
                stamp = [st.st_size, st.st_mtime_ns]
            except OSError:
                stamp = []
            layers.append([layer.get("layer_digest", ""), index, stamp])
        runs.append(layers)
    doc = {"version": FORMAT_VERSION, "runs": runs, "bare_runs": list(state.get("bare_runs", [])),
           "subtrees": state.get("subtrees", True), "opaque_xattrs": state.get("opaque_xattrs")}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


class MetaImages:
    """Builds, keeps, mounts and prunes metadata images. Thread-safe."""

    def __init__(self, root: Path, *, enabled: bool, command_of: Callable[..., list[str]],
                 on_built: Callable[[str], None]) -> None:
        self.dir = root / "metaimages"
        self._command_of = command_of
        self._on_built = on_built
        self._lock = threading.Lock()
        self._builders: dict[str, subprocess.Popen[bytes]] = {}
        self._unsupported = not enabled
        self._closed = False
        self.failed: set[str] = set()  # keys whose builder failed: not retried until the daemon restarts

    @property
    def available(self) -> bool:
        return not self._unsupported

    def image(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def build(self, key: str, state_file: Path) -> None:
        """Start building image `key` from `state_file` unless it exists or is being built."""
        with self._lock:
            if self._unsupported or self._closed or key in self.failed or self.image(key).exists():
                return
            running = self._builders.get(key)
            if running is not None and running.poll() is None:
                return
            self.dir.mkdir(parents=True, exist_ok=True)
            command = ["nice", "-n", "19", *self._command_of("snapshotter.fusefs.metamount", str(state_file),
                                                              str(self.image(key)))]
            try:
                with open(self.dir / f"{key}.log", "ab") as out:
                    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                            start_new_session=True, close_fds=True)
            except OSError as exc:
                log.warning("event=meta_failed key=%s error=%s; containers keep FUSE for metadata", key, exc)
                return
            self._builders[key] = proc
        threading.Thread(target=self._reap, args=(key, proc), daemon=True, name=f"meta-{key[:8]}").start()

    def _reap(self, key: str, proc: subprocess.Popen[bytes]) -> None:
        status = proc.wait()
        with self._lock:
            if self._builders.get(key) is proc:
                del self._builders[key]
        if status == 0 and self.image(key).exists():
            log.info("event=meta_built key=%s", key)
            self._on_built(key)
        elif status == EXIT_UNSUPPORTED:
            self._unsupported = True
            log.warning("event=meta_unsupported key=%s; containers keep the FUSE mount for metadata (see %s)",
                        key, self.dir / f"{key}.log")
        elif status > 0:  # (< 0: killed by close)
            with self._lock:
                self.failed.add(key)
            log.warning("event=meta_failed key=%s status=%d; its containers keep FUSE for metadata, see %s",
                        key, status, self.dir / f"{key}.log")

    def attach(self, key: str, target: Path) -> bool:
        """Mount image `key` at `target` unless something is mounted there; True when it is there."""
        if self._unsupported:
            return False
        if is_mountpoint(target):
            return True
        image = self.image(key)
        if not image.exists():
            return False
        try:
            target.mkdir(exist_ok=True)
            mount_erofs(image, target)
        except Exception as exc:  # the FUSE lowerdirs still work: say so and go on without
            log.warning("event=meta_mount_failed image=%s target=%s error=%s", image, target, exc)
            return False
        return True

    @staticmethod
    def detach(target: Path) -> None:
        """Unmount what is mounted at `target` (lazily: containers using it keep it)."""
        unmount_meta(target)

    def prune(self) -> list[str]:
        """Remove the images (and their files) built from a layer index file that is gone; returns their keys."""
        removed: list[str] = []
        if not self.dir.exists():
            return removed
        for image in sorted(self.dir.glob(f"*{SUFFIX}")):
            key = image.name[:-len(SUFFIX)]
            with self._lock:
                if key in self._builders:
                    continue
                try:
                    sources = json.loads(sources_path(image).read_text())
                except (OSError, ValueError):
                    sources = None
                if isinstance(sources, list) and all(os.path.exists(str(s)) for s in sources):
                    continue
                for p in (image, sources_path(image), self.dir / f"{key}.log"):
                    p.unlink(missing_ok=True)
            removed.append(key)
            log.info("event=meta_pruned key=%s", key)
        return removed

    def close(self) -> None:
        """Stop running builders (an image half written is never renamed into place)."""
        with self._lock:
            self._closed = True
            builders = list(self._builders.values())
        for proc in builders:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass


__all__ = ["FORMAT_VERSION", "MetaImages", "key_of"]
