"""Build a mount's metadata image (`python -m snapshotter.fusefs.metamount STATE_FILE IMAGE`), and mount one.

The daemon starts this, niced, when it starts an image's mount (remote/metaimages.py). It loads
the same state file as the mount process, builds the same tree (`state.load_tree`), checks
that this kernel can stack a metadata image (`probe`), and writes the EROFS metadata image of the
tree (`metaimage.build_meta_image`) to IMAGE, with IMAGE's `.sources.json` listing the layer
index files it was built from. The daemon mounts it (`mount_erofs`) next to the image's FUSE
mount; containers whose snapshots are mounted after that get `lowerdir=META/<run>...::<FUSE
mountpoint>` with `metacopy=on`: the kernel answers their lookups, stats and readdirs, and only
opening a file reaches the FUSE mount. Containers started before keep the FUSE lowerdirs; both
show the same tree.

Exit status: 0 when IMAGE exists (written by this run or one before it, or being written by
another builder), 3 when the kernel cannot stack a metadata image (the reason is logged), 2 for
a bad state file or index, 1 for any other failure. IMAGE appears whole or not at all (written to
a temporary name, synced, renamed).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fcntl
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from snapshotter.errors import SnapshotterError
from snapshotter.mountinfo import is_mountpoint

log = logging.getLogger(__name__)

IMAGE_NAME = "meta.erofs"
LOCK_NAME = "meta.lock"
EXIT_UNSUPPORTED = 3
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_PROBE_DATA = b"metadata image probe\n"


class MetaMountError(SnapshotterError):
    """A metadata image could not be mounted or stacked."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc().mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target} ({data}): {os.strerror(err)}")


def mount_erofs(image: Path, target: Path) -> None:
    """Mount the EROFS image file `image` read-only at `target`: directly (a file-backed erofs
    mount, Linux 6.12+), else through a loop device (mount(8) sets one up)."""
    try:
        _mount(str(image), str(target), "erofs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "")
        return
    except OSError as exc:
        direct_error = exc
    done = subprocess.run(["mount", "-t", "erofs", "-o", "ro,nosuid,nodev,loop", str(image), str(target)],
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise MetaMountError(f"cannot mount the metadata image {image} at {target}: {direct_error}; "
                             f"with a loop device: {done.stderr.strip() or done.returncode}")


def unmount(target: Path) -> None:
    """Lazily unmount `target` if something is mounted there (containers using it keep it)."""
    if is_mountpoint(target):
        subprocess.run(["umount", "-l", str(target)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=30, check=False)


def probe(workdir: Path) -> str | None:
    """None when this kernel stacks a metadata image as the daemon will (EROFS lower layer with a
    metacopy file redirected into a data-only lower layer, Linux 6.5+) and reads the right bytes
    through it; else why not. Mounts only under `workdir`, and undoes them."""
    from snapshotter.formats.index import Entry as IndexEntry
    from snapshotter.formats.index import EntryType, LayerIndex
    from snapshotter.fusefs.metaimage import build_meta_image
    from snapshotter.fusefs.tree import build_tree

    with tempfile.TemporaryDirectory(dir=workdir, prefix="probe-") as tmp:
        d = Path(tmp)
        (d / "data" / "0").mkdir(parents=True)
        (d / "data" / "0" / "f").write_bytes(_PROBE_DATA)
        index = LayerIndex(format="probe", entries=(
            IndexEntry(name="f", type=EntryType.REG, mode=0o644, size=len(_PROBE_DATA)),))
        (d / IMAGE_NAME).write_bytes(build_meta_image(build_tree([[index]], subtrees=True, bare_runs=(0,))))
        meta, merged = d / "meta", d / "merged"
        meta.mkdir()
        merged.mkdir()
        try:
            mount_erofs(d / IMAGE_NAME, meta)
            _mount("overlay", str(merged), "overlay", _MS_RDONLY,
                   f"metacopy=on,lowerdir={meta}/0::{d / 'data'}")
            got = (merged / "f").read_bytes()
            if got != _PROBE_DATA:
                return f"overlayfs read {got[:40]!r} through the metadata image, not the data layer's bytes"
            return None
        except (OSError, SnapshotterError) as exc:
            return str(exc)
        finally:
            unmount(merged)
            unmount(meta)


def build_image(state_file: Path, image_path: Path) -> int:
    """The command's work (see the module docstring); returns the exit status."""
    from snapshotter.fusefs.metaimage import build_meta_image
    from snapshotter.fusefs.state import load_tree, parse_state

    image_path.parent.mkdir(parents=True, exist_ok=True)
    with open(image_path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("event=meta_skipped image=%s reason=another_builder", image_path)
            return 0
        if image_path.exists():
            return 0
        began = time.monotonic()
        try:
            state = parse_state(state_file.read_bytes(), str(state_file))
            tree = load_tree(state)
        except (OSError, SnapshotterError) as exc:
            log.error("event=meta_failed image=%s error=%s", image_path, exc)
            return 2
        if any(not x.startswith("trusted.") for x in state.opaque_xattrs):
            log.warning("event=meta_unsupported image=%s reason=%r", image_path,
                        "opaque markers are not trusted.* xattrs (a userxattr overlay cannot follow metacopy)")
            return EXIT_UNSUPPORTED
        why = probe(image_path.parent)
        if why is not None:
            log.warning("event=meta_unsupported image=%s reason=%r; containers keep the FUSE mount for metadata",
                        image_path, why)
            return EXIT_UNSUPPORTED
        built = time.monotonic()
        image = build_meta_image(tree)
        sources = [spec.index_path for run in state.runs for spec in run]
        tmp = image_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(image)
            f.flush()
            os.fsync(f.fileno())
        _write_sources(image_path, sources)
        os.replace(tmp, image_path)
        log.info("event=meta_built image=%s inodes=%d image_bytes=%d tree_seconds=%.3f image_seconds=%.3f",
                 image_path, len(tree), len(image), built - began, time.monotonic() - built)
        return 0


def sources_path(image_path: Path) -> Path:
    """The JSON list of the layer index files `image_path` was built from (for garbage collection)."""
    return image_path.with_suffix(".sources.json")


def _write_sources(image_path: Path, sources: list[str]) -> None:
    tmp = sources_path(image_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(sources))
    os.replace(tmp, sources_path(image_path))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snapshotter.fusefs.metamount", description=__doc__.split("\n")[0])
    parser.add_argument("state_file", help="the mount's JSON state file (remote/mounts.py)")
    parser.add_argument("image", help="the metadata image file to write")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    args = parser.parse_args(argv)
    from snapshotter.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    return build_image(Path(args.state_file), Path(args.image))


if __name__ == "__main__":
    sys.exit(main())
