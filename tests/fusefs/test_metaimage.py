"""The metadata image (fusefs/metaimage.py, metamount.py) against the kernel: an overlay of the
EROFS image over the mount process's FUSE mount as a data-only layer must show exactly the tree
the kernel's own overlay of the materialized layers shows (the reference of test_mount.py),
contents included, and stat/readdir must not reach the FUSE mount.

Needs root and /dev/fuse (CI runs as root).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from integration.lab import wait_until
from snapshotter.formats.index import Entry, EntryType, LayerIndex
from snapshotter.fusefs.metaimage import METACOPY_XATTR, REDIRECT_XATTR, build_meta_image
from snapshotter.fusefs.metamount import build_image, image_is_whole, mount_erofs, probe, sources_path, unmount
from snapshotter.fusefs.tree import build_tree
from snapshotter.mountinfo import is_mountpoint
from tests.fusefs.layers import tree_facts
from tests.fusefs.mounting import mount_process, read_all
from tests.fusefs.test_mount import BIG, BUSYBOX, built  # noqa: F401  (the module fixture)

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    raise RuntimeError("tests/fusefs/test_metaimage.py needs root and /dev/fuse")


@contextmanager
def stacked(target: Path, lowers: list[Path], data: Path) -> Iterator[Path]:
    """A read-only overlay: `lowers` (highest first) over the data-only layer `data`, metacopy on."""
    target.mkdir(parents=True, exist_ok=True)
    opts = "ro,metacopy=on,lowerdir=" + ":".join(map(str, lowers)) + "::" + str(data)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(target)], check=True, timeout=30)
    try:
        yield target
    finally:
        unmount(target)


def fuse_requests(log_dir: Path) -> int:
    """How many FUSE requests the mount has answered (its stats file)."""
    ops = json.loads((log_dir / "stats.json").read_bytes())["fuse"]["ops"]
    return sum(int(op["count"]) for op in ops.values())


def test_kernel_stacks_metadata_images(tmp_path: Path) -> None:
    """The daemon relies on this kernel feature; CI's kernel must have it (else the test says why)."""
    assert probe(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone
    assert not any(is_mountpoint(p) for p in tmp_path.rglob("*") if p.is_dir())


def test_stacked_metadata_image_shows_the_reference_tree(built: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """Runs [L0, L1] and [L3, L4] lazily, L2 local: lowerdir=META/1:LOCAL:META/0::FUSE."""
    specs, lowers = built["specs"], built["lowers"]
    with mount_process(tmp_path, [specs[0:2], specs[3:5]], subtrees=True,
                       stats_file=str(tmp_path / "stats.json")) as m:
        meta, image = tmp_path / "meta", tmp_path / "images" / "x.erofs"
        assert build_image(m.state_path, image) == 0, m.log()
        assert json.loads(sources_path(image).read_text())["sources"] == [s["index"] for s in specs[0:2] + specs[3:5]]
        assert image_is_whole(image)
        meta.mkdir()
        mount_erofs(image, meta)
        try:
            assert sorted(os.listdir(meta)) == ["0", "1"]
            big = os.lstat(meta / "0/big")
            assert big.st_size == len(BIG)  # a hole of its size: the bytes live in the FUSE mount
            assert os.getxattr(meta / "0/big", METACOPY_XATTR, follow_symlinks=False) == b""
            assert os.getxattr(meta / "0/big", REDIRECT_XATTR, follow_symlinks=False) == b"/0/big"
            # Hard links stay one inode, and every name redirects to the first name's path.
            bb, sh = os.lstat(meta / "0/bin/busybox"), os.lstat(meta / "0/bin/sh")
            assert bb.st_ino == sh.st_ino and bb.st_nlink == 2
            assert os.getxattr(meta / "0/bin/sh", REDIRECT_XATTR) == b"/0/bin/busybox"
            wh = os.lstat(meta / "1/localonly")
            assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
            assert os.getxattr(meta / "1/usr/share/doc", "trusted.overlay.opaque") == b"y"
            # A second build finds the image there and leaves it.
            before = image.stat().st_mtime_ns
            assert build_image(m.state_path, image) == 0 and image.stat().st_mtime_ns == before
            with stacked(tmp_path / "merged", [meta / "1", lowers[2], meta / "0"], m.mountpoint) as merged:
                time.sleep(1.2)  # the stats file is rewritten every second
                before = fuse_requests(tmp_path)
                names = [os.path.join(d, n) for d, ds, fs in os.walk(merged) for n in ds + fs]
                for p in names:
                    os.lstat(p)
                time.sleep(1.2)
                after = fuse_requests(tmp_path)
                assert len(names) > 30
                assert after == before, (before, after)  # no FUSE round trip
                got = tree_facts(merged)
                del got["."]
                assert got == built["reference"]
                assert read_all(merged / "bin/sh") == BUSYBOX
                assert read_all(merged / "big") == BIG
        finally:
            unmount(meta)
    assert not is_mountpoint(meta)


def test_meta_image_of_special_files_matches_the_tree(tmp_path: Path) -> None:
    """Kernel oracle for the node kinds a plain tree has: modes, owners, mtimes (ns), devices,
    fifo, symlink targets, empty and large sizes, xattrs."""
    t = 1_700_000_000_123_456_789
    cap = struct.pack("<5I", 0x0200_0001, 1 << 10, 0, 0, 0)  # VFS cap v2, effective: cap_net_bind_service
    entries = (
        Entry(name="", type=EntryType.DIR, mode=0o751, uid=3, gid=4, mtime_ns=t),
        Entry(name="dev", type=EntryType.DIR, mode=0o755, mtime_ns=t),
        Entry(name="dev/null", type=EntryType.CHAR, mode=0o666, dev_major=1, dev_minor=3, mtime_ns=t),
        Entry(name="dev/sda", type=EntryType.BLOCK, mode=0o660, dev_major=8, dev_minor=0, mtime_ns=t),
        Entry(name="fifo", type=EntryType.FIFO, mode=0o600, mtime_ns=t),
        Entry(name="huge", type=EntryType.REG, mode=0o4755, uid=70000, gid=70001, size=5 << 40, mtime_ns=t + 1),
        Entry(name="empty", type=EntryType.REG, mode=0o644, size=0, mtime_ns=t),
        Entry(name="ln", type=EntryType.SYMLINK, mode=0o777, link_target="x" * 300, mtime_ns=t),
        Entry(name="x", type=EntryType.REG, mode=0o644, size=1, mtime_ns=t,
              xattrs={"user.k": b"v", "security.capability": cap}),
    )
    tree = build_tree([[LayerIndex(format="test", entries=entries)]], subtrees=False)
    (tmp_path / "meta.erofs").write_bytes(build_meta_image(tree))
    mnt = tmp_path / "m"
    mnt.mkdir()
    mount_erofs(tmp_path / "meta.erofs", mnt)
    try:
        for e in entries:
            st = os.lstat(mnt / e.name)
            node = tree.resolve(e.name)
            assert node is not None
            assert (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns) == (node.st_mode, e.uid, e.gid, e.mtime_ns), e
            if e.type in (EntryType.CHAR, EntryType.BLOCK):
                assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (e.dev_major, e.dev_minor)
        assert os.lstat(mnt / "huge").st_size == 5 << 40
        assert os.readlink(mnt / "ln") == "x" * 300
        assert os.getxattr(mnt / "x", "user.k") == b"v"
        assert os.getxattr(mnt / "x", "security.capability") == cap
        assert read_all(mnt / "x") == b"\x00"  # the image has no data: a direct read gives zeros
    finally:
        unmount(mnt)


def test_an_image_from_an_earlier_boot_is_checked_against_its_crc(tmp_path: Path) -> None:
    """Images are not synced: one built before a crash may be short or zero-filled on disk."""
    image = tmp_path / "k.erofs"
    data = b"\x01" * 10_000
    image.write_bytes(data)
    doc = {"sources": [], "boot_id": "another-boot", "bytes": len(data), "crc32": zlib.crc32(data)}
    sources_path(image).write_text(json.dumps(doc))
    assert image_is_whole(image)
    image.write_bytes(b"\x00" * len(data))  # what a crash can leave: the size, not the bytes
    assert not image_is_whole(image)
    image.write_bytes(data[:5000])
    assert not image_is_whole(image)
    sources_path(image).unlink()
    assert not image_is_whole(image)


def _wait_for_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


def test_the_mount_process_writes_its_image_once_quiet(built: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """From a forked child, after a second without requests; the same image the builder writes."""
    image = tmp_path / "images" / "k.erofs"
    with mount_process(tmp_path, [built["specs"][0:2]], subtrees=True, bare_runs=[0], meta_image=str(image)) as m:
        assert read_all(m.mountpoint / "0/etc/passwd")  # a request: the quiet second starts again
        assert _wait_for_file(image, 30), m.log()
        assert "event=meta_writing" in m.log() and image_is_whole(image)
        ref = tmp_path / "ref.erofs"
        assert build_image(m.state_path, ref) == 0
        assert image.read_bytes() == ref.read_bytes()
        time.sleep(0.5)
        children = subprocess.run(["ps", "--ppid", str(m.proc.pid), "-o", "stat="], capture_output=True,
                                  text=True, timeout=10).stdout.split()
        assert not any(s.startswith("Z") for s in children), "the writer was not reaped"
        assert m.proc.poll() is None  # still serving


def test_a_mount_stopped_before_it_was_quiet_still_leaves_its_image(built: dict[str, Any],  # noqa: F811
                                                                   tmp_path: Path) -> None:
    image = tmp_path / "images" / "k.erofs"
    with mount_process(tmp_path, [built["specs"][0:2]], subtrees=True, bare_runs=[0], meta_image=str(image)) as m:
        assert not image.exists()
    assert m.proc.returncode == 0
    assert _wait_for_file(image, 30), m.log()
    assert image_is_whole(image)


def test_a_writer_whose_root_is_gone_makes_nothing_again(built: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """The daemon's root removed while a mount's forked writer runs (a test lab's teardown left
    ROOT/metaimages/ made again by it): the writer fails, and the root stays gone."""
    root = tmp_path / "root"
    image = root / "metaimages" / "k.erofs"
    with mount_process(tmp_path, [built["specs"][0:2]], subtrees=True, bare_runs=[0], meta_image=str(image)) as m:
        pass  # stopped before it was quiet: the writer is forked as it stops
    match = re.search(r"event=meta_writing .*pid=(\d+)", m.log())
    assert match, m.log()
    pid = int(match.group(1))
    wait_until(f"the metadata image writer (pid {pid}) to end", lambda: not os.path.exists(f"/proc/{pid}"), 30)
    assert not root.exists()
