"""Write and mount metadata images (fusefs/metaimage.py); `python -m snapshotter.fusefs.metamount STATE IMAGE`.

`write_image` writes the EROFS metadata image of a mount's tree to IMAGE, with IMAGE's
`.sources.json` listing the layer index files it was built from (and the boot and CRC that
`image_is_whole` checks). A mount process calls it through `fork_writer` once it is quiet
(process.py MetaWriter); the daemon checks once that the kernel can stack such an image (`probe`)
and mounts it (`mount_erofs`) next to the image's FUSE mount (remote/metaimages.py). Containers
whose snapshots are mounted after that get `lowerdir=META/<run>...::<FUSE mountpoint>` with
`metacopy=on`: the kernel answers their lookups, stats and readdirs, and only opening a file
reaches the FUSE mount. Containers started before keep the FUSE lowerdirs; both show the same tree.

The command does the same from a state file, by hand: it loads the tree as the mount process does
(`state.load_tree`), probes the kernel (unless `--no-probe`), and writes IMAGE at SCHED_IDLE.
Its exit status: 0 when IMAGE exists (written by this run or one before it, or being written by
another writer), 3 when the kernel cannot stack a metadata image (the reason is logged), 2 for a
bad state file or index, 1 for any other failure. IMAGE appears under its name only once written
(a temporary name, then a rename).
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
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapshotter.errors import SnapshotterError
from snapshotter.mountinfo import is_mountpoint

if TYPE_CHECKING:
    from snapshotter.fusefs.state import MountState
    from snapshotter.fusefs.tree import MountTree

log = logging.getLogger(__name__)

IMAGE_NAME = "meta.erofs"
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


def build_image(state_file: Path, image_path: Path, *, check_kernel: bool = True) -> int:
    """The command's work (see the module docstring); returns the exit status. check_kernel=False
    skips `probe`."""
    from snapshotter.fusefs.state import load_tree, parse_state

    began = time.monotonic()
    try:
        state = parse_state(state_file.read_bytes(), str(state_file))
        tree = load_tree(state)
    except (OSError, SnapshotterError) as exc:
        log.error("event=meta_failed image=%s error=%s", image_path, exc)
        return 2
    image_path.parent.mkdir(parents=True, exist_ok=True)
    why = unstackable(state) or (probe(image_path.parent) if check_kernel else None)
    if why is not None:
        log.warning("event=meta_unsupported image=%s reason=%r", image_path, why)
        return EXIT_UNSUPPORTED
    built = time.monotonic()
    size = write_image(tree, state, image_path)
    log.info("event=meta_built image=%s inodes=%d image_bytes=%d tree_seconds=%.3f image_seconds=%.3f",
             image_path, len(tree), size, built - began, time.monotonic() - built)
    return 0


def unstackable(state: MountState) -> str | None:
    """Why a metadata image of this state's tree cannot work, or None."""
    if any(not x.startswith("trusted.") for x in state.opaque_xattrs):
        return "opaque markers are not trusted.* xattrs (a userxattr overlay cannot follow metacopy)"
    return None


def write_image(tree: MountTree, state: MountState, image_path: Path) -> int:
    """Write the metadata image of `tree` (built from `state`) to `image_path`, unless it exists
    or another writer holds its lock; returns its size in bytes (0 when not written).

    Not synced (an fsync forces a journal commit, which a container starting meanwhile may wait
    on): the sources file records this boot and the image's CRC, and `image_is_whole` checks the
    CRC of an image from an earlier boot, which a crash may have left short or zero-filled.

    Only the image's own directory is made: FileNotFoundError when the one above it is gone (the
    daemon's root removed while a forked writer ran), rather than a root made again that nobody
    owns.
    """
    from snapshotter.fusefs.metaimage import build_meta_image

    image_path.parent.mkdir(exist_ok=True)
    with open(image_path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        if image_path.exists():
            return 0
        image = build_meta_image(tree)
        tmp = image_path.with_name(f"{image_path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(image)
        _write_sources(image_path, {"sources": [spec.index_path for run in state.runs for spec in run],
                                    "boot_id": current_boot_id(), "bytes": len(image), "crc32": zlib.crc32(image)})
        os.replace(tmp, image_path)
        return len(image)


def fork_writer(tree: MountTree, state: MountState, image_path: Path | None,
                first: Callable[[], None] | None = None) -> int | None:
    """Write the metadata image from a forked child at SCHED_IDLE (it shares the tree already in
    memory: no indexes to load again, and the parent's memory does not grow), after `first`
    (other writing of the mount's, e.g. derived indexes, done by the same child). Returns the
    child's pid, or None when there is nothing to write (no `first`, and no image wanted or it
    is there). The child closes every inherited file descriptor first (the FUSE device among
    them), touches nothing of the parent's event loop, and ends with os._exit: 0 when written
    (or already there), 1 on any failure."""
    image_wanted = image_path is not None and not image_path.exists() and unstackable(state) is None
    if not image_wanted and first is None:
        return None
    import snapshotter.fusefs.metaimage  # noqa: F401  (imported here, so the child imports nothing)

    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        os.closerange(3, 1 << 20)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
        if first is not None:
            first()
        if image_wanted:
            assert image_path is not None
            write_image(tree, state, image_path)
        status = 0
    except BaseException:  # noqa: BLE001 - a child must never return into the parent's code
        pass
    finally:
        os._exit(status)


def sources_path(image_path: Path) -> Path:
    """The JSON list of the layer index files `image_path` was built from (for garbage collection)."""
    return image_path.with_suffix(".sources.json")


def _write_sources(image_path: Path, doc: dict[str, object]) -> None:
    tmp = sources_path(image_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, sources_path(image_path))


def read_sources(image_path: Path) -> dict[str, Any] | None:
    """The sources document of `image_path` ({"sources": [index files], "boot_id", "bytes", "crc32"}),
    or None when it is missing or unreadable."""
    try:
        doc = json.loads(sources_path(image_path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("sources"), list) else None


def current_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def image_is_whole(image_path: Path) -> bool:
    """Whether `image_path` holds all the bytes its writer wrote: trusted as is when built in this
    boot (the page cache has them, synced or not), else its size and CRC are checked."""
    doc = read_sources(image_path)
    if doc is None:
        return False
    try:
        if doc.get("boot_id") and doc.get("boot_id") == current_boot_id():
            return image_path.stat().st_size == doc.get("bytes")
        data = image_path.read_bytes()
    except OSError:
        return False
    return len(data) == doc.get("bytes") and zlib.crc32(data) == doc.get("crc32")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snapshotter.fusefs.metamount", description=__doc__.split("\n")[0])
    parser.add_argument("state_file", help="the mount's JSON state file (remote/mounts.py)")
    parser.add_argument("image", help="the metadata image file to write")
    parser.add_argument("--no-probe", action="store_true",
                        help="do not check that the kernel can stack the image (the caller did)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    args = parser.parse_args(argv)
    from snapshotter.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:  # CPU only when nothing else wants it: containers are starting meanwhile
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass
    return build_image(Path(args.state_file), Path(args.image), check_kernel=not args.no_probe)


if __name__ == "__main__":
    sys.exit(main())
