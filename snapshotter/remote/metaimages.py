"""The daemon's metadata images: one per tree, written by mount processes, kept, mounted next to mounts.

    ROOT/metaimages/<key>.erofs          a metadata image (fusefs/metaimage.py)
    ROOT/metaimages/<key>.sources.json   the layer index files it was built from, its boot and CRC

The key is a digest of what the mount's tree is made of (each run's layer digests and index files,
their sizes and mtimes, the bare runs, the image format's version), so the same image pulled again,
or its mount stopped and started again, finds its metadata image already there. The daemon names
the image's path in each mount's state file ("meta_image"); the mount process writes it from a
forked child once it has been quiet for a second, or as it stops (fusefs/process.py MetaWriter), so
nothing competes with a starting container. The daemon mounts it (`attach`) next to a serving
mount when it exists: when the mount starts, and from its watcher once a second. An image whose
index files are gone is removed by `prune` (on the daemon's garbage collection).

The kernel is probed once, in the background, when this is made (`metamount.probe`); nothing is
mounted before it passed, and a failed probe turns metadata images off for this daemon.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from snapshotter.fusefs.metamount import (
    image_is_whole,
    mount_erofs,
    probe,
    read_sources,
    sources_path,
)
from snapshotter.fusefs.metamount import unmount as unmount_meta
from snapshotter.mountinfo import is_mountpoint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when build_meta_image's output for the same tree changes
SUFFIX = ".erofs"
META_DIR = "meta"  # where a mount's metadata image is mounted: ROOT/mounts/<id>/meta


def key_of(state: Mapping[str, Any]) -> str:
    """The metadata image key of a mount state document (remote/mounts.py writes it). A layer
    counts by its parse key when it has one (the stored metadata bytes and the parse the tree
    came from), else by its index file's size and mtime: the index file of a layer stored as
    metadata bytes appears later (the first mount's quiet-time child writes it, then the image),
    and a key that followed it named every mount after the first an image nobody had written."""
    runs = []
    for run in state.get("runs", []):
        layers = []
        for layer in run:
            index = str(layer["index"])
            parse_key = layer.get("parse_key")
            stamp: list[Any]
            if isinstance(parse_key, str) and parse_key:
                stamp = ["parse", parse_key]
            else:
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
    """Names, mounts and prunes metadata images. Thread-safe."""

    def __init__(self, root: Path, *, enabled: bool,
                 probe_kernel: Callable[[Path], str | None] = probe) -> None:
        self.dir = root / "metaimages"
        self._unsupported = not enabled
        self._probed = threading.Event()
        if enabled:  # once, now: its mounts and unmounts would hold up a container's own
            threading.Thread(target=self._probe, args=(probe_kernel,), daemon=True, name="meta-probe").start()

    def _probe(self, probe_kernel: Callable[[Path], str | None]) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            why = probe_kernel(self.dir)
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use metadata images
            why = repr(exc)
        if why is not None:
            self._unsupported = True
            log.warning("event=meta_unsupported reason=%r; containers keep the FUSE mount for metadata", why)
        self._probed.set()

    @property
    def available(self) -> bool:
        return not self._unsupported

    def wait_probed(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the kernel probe; True once it is done (either way)."""
        return self._probed.wait(timeout)

    def image(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def attach(self, key: str, target: Path) -> bool:
        """Mount image `key` at `target` unless something is mounted there; True when it is there."""
        if self._unsupported or not self._probed.is_set():
            return False
        if is_mountpoint(target):
            return True
        image = self.image(key)
        if not image.exists():
            return False
        if not image_is_whole(image):  # left short by a crash before it reached the disk
            log.warning("event=meta_damaged image=%s; the image's next mount writes it again", image)
            for p in (image, sources_path(image)):
                p.unlink(missing_ok=True)
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
            doc = read_sources(image)
            if doc is not None and all(os.path.exists(str(s)) for s in doc["sources"]):
                continue
            for p in (image, sources_path(image), image.with_suffix(".lock")):
                p.unlink(missing_ok=True)
            removed.append(key)
            log.info("event=meta_pruned key=%s", key)
        for tmp in self.dir.glob(f"*{SUFFIX}.*.tmp"):  # left by a writer that died: KEY.erofs.PID.tmp
            pid = tmp.name.split(".")[-2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                tmp.unlink(missing_ok=True)
        return removed


__all__ = ["FORMAT_VERSION", "META_DIR", "MetaImages", "key_of"]
