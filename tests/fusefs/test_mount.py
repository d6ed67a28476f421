"""Real mounts: the mount process serving a 5-layer image through /dev/fuse, compared with the
kernel's own answer (an overlay mount of the same layers materialized as lowerdirs, the way
containerd's overlay snapshotter stores them); subtrees under an overlay interleaved with a local
layer; faults (EIO, timeouts); stop by SIGTERM and by external unmount.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from snapshotter.formats.index import Compression, EntryType
from snapshotter.formats.index_codec import dump_index
from tests.fusefs.layers import T0, Layer, tree_facts
from tests.fusefs.mounting import (
    is_mounted,
    layer_spec,
    mount_process,
    overlay,
    read_all,
    wait_for,
)

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):  # the project runs these as root; say so loudly
    raise RuntimeError("tests/fusefs/test_mount.py needs root and /dev/fuse")

RNG = random.Random(7)
BIG = RNG.randbytes(300 * 1024)
BUSYBOX = RNG.randbytes(10_000)


def image() -> list[Layer]:
    l0 = (Layer()
          .dir("", mode=0o755)
          .dir("bin").file("bin/busybox", BUSYBOX, mode=0o755).hardlink("bin/sh", "bin/busybox")
          .hardlink("bin/ls", "bin/busybox")
          .dir("etc").file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n").file("etc/hosts", b"127.0.0.1 localhost\n")
          .file("etc/xattr", b"x", xattrs=MappingProxyType({"user.comment": b"hi\x00there"}))
          .dir("usr").dir("usr/lib").file("usr/lib/libold.so", b"\x7fELF old")
          .dir("usr/share").dir("usr/share/doc").file("usr/share/doc/a", b"a").file("usr/share/doc/b", b"b")
          .dir("dev").device("dev/null", EntryType.CHAR, 1, 3).device("dev/sda", EntryType.BLOCK, 8, 0, mode=0o660)
          .dir("run").device("run/fifo", EntryType.FIFO, mode=0o600)
          .symlink("link", "etc/passwd")
          .file("gone", b"to be deleted")
          .dir("gonedir").dir("gonedir/sub").file("gonedir/sub/f", b"f")
          .dir("opq").file("opq/o1", b"1").file("opq/o2", b"2")
          .file("fd", b"a file, later a dir")
          .file("big", BIG, mode=0o640, uid=1000, gid=1000)
          .file("empty", b"")
          .dir("opt").file("opt/old", b"old").dir("mix").file("mix/a", b"a"))
    l1 = (Layer(compression=Compression.ZSTD, chunk_size=8192)
          .dir("", mode=0o755, mtime_ns=T0 + 1)
          .whiteout("gone").whiteout("gonedir")
          .dir("opq").opaque("opq").file("opq/o3", b"3")
          .dir("etc", mode=0o750, mtime_ns=T0 + 1).file("etc/passwd", b"root:x:0:0::/root:/bin/ash\n", mode=0o600,
                                                        uid=5, gid=6)
          .dir("fd").file("fd/inner", b"inner")
          .dir("bin").file("bin/ls", b"a real ls", mode=0o755)
          .dir("usr").dir("usr/share").dir("usr/share/doc").whiteout("usr/share/doc/a")
          .file("new/implied/deep/file", b"deep"))
    l2 = (Layer()
          .whiteout("link")
          .dir("usr").dir("usr/lib").whiteout("usr/lib/libold.so").file("usr/lib/libnew.so", b"\x7fELF new")
          .dir("gonedir").file("gonedir/new", b"new")
          .file("localonly", b"only in layer 2"))
    l3 = (Layer()
          .file("gone", b"back")
          .dir("fd").whiteout("fd/inner").file("fd/other", b"other")
          .whiteout("localonly")
          .dir("etc", mode=0o755, mtime_ns=T0 + 3).whiteout("etc/hosts")
          .dir("usr").dir("usr/share").dir("usr/share/doc").opaque("usr/share/doc").file("usr/share/doc/c", b"c")
          .whiteout("opt").file("mix", b"mix is a file"))
    l4 = (Layer(compression=Compression.ZSTD)
          .dir("run").dir("run/fifo").file("run/fifo/x", b"fifo is a dir now")
          .dir("opq", mode=0o700, mtime_ns=T0 + 4)
          .dir("opt").file("opt/new", b"new").dir("mix").file("mix/b", b"b"))
    return [l0, l1, l2, l3, l4]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Blobs + persisted indexes + materialized lowerdirs of the image, and the kernel reference."""
    d = tmp_path_factory.mktemp("image")
    layers = image()
    specs, lowers = [], []
    for i, layer in enumerate(layers):
        blob = d / f"layer{i}.blob"
        index = layer.build(blob)
        index_path = d / f"layer{i}.index.json"
        index_path.write_bytes(dump_index(index))
        specs.append(layer_spec(index_path, {"kind": "file", "blob_path": str(blob)}, f"layer{i}"))
        lower = d / f"lower{i}"
        lower.mkdir()
        layer.materialize(lower)
        lowers.append(lower)
    with overlay(d / "reference", list(reversed(lowers))) as ref:
        facts = tree_facts(ref)
        # The root's attributes come from the top lowerdir's root, which layers 2-4 do not list
        # (containerd would keep layer 1's); compared separately.
        del facts["."]
        yield {"dir": d, "specs": specs, "lowers": lowers, "reference": facts, "layers": layers}


def test_reference_is_what_we_think(built: dict[str, Any]) -> None:
    """Sanity of the oracle itself, so a bug in materializing cannot hide one in the mount."""
    ref = built["reference"]
    assert "gone" in ref and ref["gone"].sha256 is not None
    for absent in ("link", "localonly", "etc/hosts", "usr/lib/libold.so", "usr/share/doc/a", "usr/share/doc/b",
                   "opq/o1", "gonedir/sub", "fd/inner", "opt/old", "mix/a"):
        assert absent not in ref, absent
    assert ref["run/fifo"].type == "dir" and ref["fd"].type == "dir"


def _read_ahead_kb(mountpoint: Path) -> int:
    dev = os.stat(mountpoint).st_dev
    return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())


@pytest.mark.parametrize("setting", [None, 0, 512])
def test_mount_read_ahead_window(built: dict[str, Any], tmp_path: Path, setting: int | None) -> None:
    """1 MiB by default (one FUSE request per MiB of a sequential read, not per 128 KiB); the
    state's read_ahead_kb sets it, 0 leaves the kernel's default (128 KiB for FUSE)."""
    extra: dict[str, Any] = {} if setting is None else {"read_ahead_kb": setting}
    expected = {None: 1024, 0: 128, 512: 512}[setting]
    with mount_process(tmp_path, [built["specs"]], subtrees=False, **extra) as m:
        # Set once the kernel has our INIT reply, which the ready file does not wait for.
        deadline = time.monotonic() + 10
        while _read_ahead_kb(m.mountpoint) != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _read_ahead_kb(m.mountpoint) == expected, m.log()
        assert read_all(m.mountpoint / "big") == BIG


def test_single_run_mount_matches_kernel_overlay(built: dict[str, Any], tmp_path: Path) -> None:
    with mount_process(tmp_path, [built["specs"]], subtrees=False, fetch_timeout=10) as m:
        mnt = m.mountpoint
        # First-read order, dumped on SIGUSR1, before anything else reads files.
        assert read_all(mnt / "etc/passwd") == b"root:x:0:0::/root:/bin/ash\n"
        assert read_all(mnt / "big") == BIG
        m.proc.send_signal(signal.SIGUSR1)
        wait_for(m.record_path.exists, 10, "the record file")
        record = json.loads(m.record_path.read_bytes())
        assert [f["path"] for f in record["files"]] == ["etc/passwd", "big"]
        assert record["files"][0] == {"path": "etc/passwd", "layer": 1, "name": "etc/passwd"}

        got = tree_facts(mnt)
        root = got.pop(".")
        assert (root.mode, root.mtime_ns) == (0o755, T0 + 1)
        assert got == built["reference"]

        # Hard links: one inode; nlink counts the names left (bin/ls was replaced in layer 1).
        bb, sh, ls = (os.lstat(mnt / p) for p in ("bin/busybox", "bin/sh", "bin/ls"))
        assert bb.st_ino == sh.st_ino != ls.st_ino and bb.st_nlink == 2 and ls.st_nlink == 1
        assert read_all(mnt / "bin/sh") == BUSYBOX
        assert os.lstat(mnt / "new/implied").st_mode & 0o7777 == 0o755
        assert os.getxattr(mnt / "etc/xattr", "user.comment") == b"hi\x00there"
        assert os.listxattr(mnt / "etc/xattr") == ["user.comment"]
        # Random access within the chunked file, from several threads at once (O_DIRECT-free
        # reads may be served from the page cache; each still must be right).
        def check(start: int) -> bool:
            with open(mnt / "big", "rb", buffering=0) as f:
                f.seek(start)
                return f.read(70_000) == BIG[start:start + 70_000]

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(check, [123_457, 0, 4095, 4097, 200_000, 250_001, 77, 299_999]))

        sv = os.statvfs(mnt)
        ready = m.ready()
        assert sv.f_files == ready["inodes"] == len(got)  # root counted, bin/sh shares busybox's inode
        assert sv.f_blocks == (ready["file_bytes"] + sv.f_frsize - 1) // sv.f_frsize
        total = sum(f.size for p, f in got.items() if f.type == "reg" and p != "bin/sh")
        assert ready["file_bytes"] == total
        assert sv.f_bfree == 0

        # Read-only.
        for op in (lambda: open(mnt / "new-file", "w"), lambda: os.mkdir(mnt / "d"),
                   lambda: os.unlink(mnt / "big"), lambda: open(mnt / "big", "r+b")):
            with pytest.raises(OSError) as info:
                op()
            assert info.value.errno == errno.EROFS
        mountinfo = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                     if f" {mnt} " in line]
        assert mountinfo and " lazy " in mountinfo[0] and " ro," in mountinfo[0] + ","
        assert "allow_other" in mountinfo[0] and "default_permissions" in mountinfo[0]
    assert m.proc.returncode == 0, m.log()
    assert not is_mounted(mnt) and not m.ready_path.exists()


def test_subtrees_under_overlay_with_a_local_layer(built: dict[str, Any], tmp_path: Path) -> None:
    """Runs [L0, L1] and [L3, L4] lazily, L2 as a local dir: lowerdir=FUSE/1:LOCAL:FUSE/0."""
    specs, lowers = built["specs"], built["lowers"]
    with mount_process(tmp_path, [specs[0:2], specs[3:5]], subtrees=True) as m:
        mnt = m.mountpoint
        assert sorted(os.listdir(mnt)) == ["0", "1"]
        # Markers as overlayfs expects them in a lowerdir.
        wh = os.lstat(mnt / "1/localonly")
        assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
        assert os.getxattr(mnt / "1/usr/share/doc", "trusted.overlay.opaque") == b"y"
        assert os.getxattr(mnt / "0/opq", "trusted.overlay.opaque") == b"y"
        assert os.getxattr(mnt / "0/fd", "trusted.overlay.opaque") == b"y"  # a dir replacing a file
        with pytest.raises(OSError) as info:
            os.getxattr(mnt / "1/run/fifo", "trusted.overlay.opaque")
        assert info.value.errno == errno.ENODATA
        with overlay(tmp_path / "merged", [mnt / "1", lowers[2], mnt / "0"]) as merged:
            got = tree_facts(merged)
            del got["."]
            assert got == built["reference"]
            assert read_all(merged / "gone") == b"back"
            assert sorted(os.listdir(merged / "usr/share/doc")) == ["c"]
            assert sorted(os.listdir(merged / "gonedir")) == ["new"]
            assert sorted(os.listdir(merged / "fd")) == ["other"]
            assert sorted(os.listdir(merged / "opt")) == ["new"] and sorted(os.listdir(merged / "mix")) == ["b"]
            assert not os.path.lexists(merged / "localonly") and not os.path.lexists(merged / "link")
            assert read_all(merged / "big") == BIG
    assert m.proc.returncode == 0, m.log()


def test_image_without_xattrs_turns_getxattr_off_in_the_kernel(built: dict[str, Any], tmp_path: Path) -> None:
    """Layer 2 alone has no xattrs: the mount answers the first getxattr with ENOSYS, so the kernel
    answers the rest itself (EOPNOTSUPP) and overlayfs's per-lookup trusted.overlay.* queries
    stop costing a request each. The same mount with an xattr (test above) keeps answering."""
    stats = tmp_path / "stats.json"
    with mount_process(tmp_path, [built["specs"][2:3]], subtrees=False, stats_file=str(stats)) as m:
        mnt = m.mountpoint
        for name in ("usr/lib/libnew.so", "gonedir/new", "usr"):
            with pytest.raises(OSError) as info:
                os.getxattr(mnt / name, "user.comment")
            assert info.value.errno == errno.EOPNOTSUPP
        assert os.listxattr(mnt / "gonedir/new") == []
        (tmp_path / "empty").mkdir()
        with overlay(tmp_path / "merged", [mnt, tmp_path / "empty"]) as merged:
            found = sorted(str(p.relative_to(merged)) for p in merged.rglob("*"))
            assert found == sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*"))
            assert read_all(merged / "gonedir/new") == b"new"
        m.proc.send_signal(signal.SIGTERM)
        m.proc.wait(timeout=10)
    ops = json.loads(stats.read_text())["fuse"]["ops"]
    assert ops["getxattr"]["count"] == 1, ops  # the first one; none after it, overlay's included


def test_faults_give_eio_and_do_not_wedge_the_mount(built: dict[str, Any], tmp_path: Path) -> None:
    d = tmp_path / "layers"
    d.mkdir()
    ok = Layer().dir("ok").file("ok/data", b"fine" * 1000).file("ok/corrupt", b"bad digest" * 100)
    failing = Layer().dir("fail").file("fail/data", b"never served")
    hanging = Layer().dir("hang").file("hang/data", b"never served either")
    specs = []
    for name, layer, reader in (("ok", ok, None), ("fail", failing, {"kind": "fail"}),
                                ("hang", hanging, {"kind": "hang"})):
        blob = d / f"{name}.blob"
        index = layer.build(blob, corrupt=frozenset({"ok/corrupt"}))
        (d / f"{name}.json").write_bytes(dump_index(index))
        specs.append(layer_spec(d / f"{name}.json", reader or {"kind": "file", "blob_path": str(blob)}, name))
    timeout = 1.5
    with mount_process(tmp_path, [specs], module="tests.fusefs.fault_mount", subtrees=False,
                       fetch_timeout=timeout) as m:
        mnt = m.mountpoint

        def errno_of(path: Path) -> tuple[int | None, float]:
            start = time.monotonic()
            try:
                read_all(path)
            except OSError as exc:
                return exc.errno, time.monotonic() - start
            return None, time.monotonic() - start

        assert errno_of(mnt / "ok/corrupt")[0] == errno.EIO  # DigestMismatch from the file reader
        code, took = errno_of(mnt / "fail/data")
        assert code == errno.EIO and took < 1.0

        # A hanging read ends in EIO after fetch_timeout, and other reads proceed meanwhile.
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(hang=errno_of(mnt / "hang/data")), daemon=True)
        t.start()
        time.sleep(0.2)
        start = time.monotonic()
        assert read_all(mnt / "ok/data") == b"fine" * 1000
        assert time.monotonic() - start < 1.0
        t.join(timeout=timeout + 10)
        assert not t.is_alive()
        code, took = result["hang"]
        assert code == errno.EIO and timeout - 0.2 <= took < timeout + 5
        assert sorted(os.listdir(mnt / "ok")) == ["corrupt", "data"]

        # SIGTERM with a read in flight: the process stops at once, the reader gets an error.
        t = threading.Thread(target=lambda: result.update(stopped=errno_of(mnt / "hang/data")), daemon=True)
        t.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert m.stop() == 0, m.log()
        assert time.monotonic() - start < timeout
        t.join(timeout=10)
        assert not t.is_alive() and result["stopped"][0] in (errno.ENOTCONN, errno.EIO, errno.ECONNABORTED)
    assert m.proc.returncode == 0, m.log()
    assert "took over" in m.log() and "FetchError" in m.log()


def test_external_unmount_ends_the_process_and_a_stale_mount_is_replaced(built: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    specs = built["specs"][:1]
    with mount_process(tmp_path, [specs], subtrees=False) as m:
        subprocess.run(["fusermount3", "-u", str(m.mountpoint)], check=True, timeout=30)
        m.proc.wait(timeout=15)
        assert m.proc.returncode == 0, m.log()
        assert not m.ready_path.exists()
    # A mount process killed hard leaves "Transport endpoint is not connected"; the next one
    # for the same state file detaches it and mounts again.
    with mount_process(tmp_path, [specs], subtrees=False) as m:
        m.proc.kill()
        m.proc.wait(timeout=15)
        with pytest.raises(OSError) as info:
            os.stat(m.mountpoint / "etc")
        assert info.value.errno == errno.ENOTCONN
        m.ready_path.unlink()
    with mount_process(tmp_path, [specs], subtrees=False) as m:
        assert read_all(m.mountpoint / "etc/passwd") == b"root:x:0:0::/root:/bin/sh\n"
    assert m.proc.returncode == 0, m.log()


def test_bad_state_file_exits_2(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"version": 1, "mountpoint": str(tmp_path), "ready_file": "x", "runs": []}))
    proc = subprocess.run([sys.executable, "-m", "snapshotter.fusefs", str(state)],
                          capture_output=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and b"no runs" in proc.stderr


def test_setuid_works_through_overlay_but_not_on_the_raw_mount() -> None:
    """libfuse mounts nosuid,nodev (the raw mount is no setuid door on the host); overlayfs
    checks its own mount's flags, so a setuid binary still works in the container rootfs."""
    work = Path(tempfile.mkdtemp(prefix="fusefs-suid-"))  # /tmp itself: reachable by uid 65534
    try:
        os.chmod(work, 0o755)
        idbin = Path("/usr/bin/id").read_bytes()
        specs = []
        for i, layer in enumerate([Layer(chunk_size=1 << 16).dir("bin").file("bin/id", idbin, mode=0o4755),
                                   Layer().file("x", b"")]):
            index = layer.build(work / f"blob{i}")
            (work / f"index{i}.json").write_bytes(dump_index(index))
            specs.append(layer_spec(work / f"index{i}.json", {"kind": "file", "blob_path": str(work / f"blob{i}")}))
        proc_dir = work / "proc"
        proc_dir.mkdir()
        os.chmod(proc_dir, 0o755)

        def euid_running(path: Path) -> str:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(path), "-u"]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip()

        with mount_process(proc_dir, [[specs[0]], [specs[1]]]) as m:
            assert euid_running(m.mountpoint / "0/bin/id") == "65534"
            with overlay(work / "rootfs", [m.mountpoint / "1", m.mountpoint / "0"]) as rootfs:
                assert euid_running(rootfs / "bin/id") == "0"
    finally:
        shutil.rmtree(work, ignore_errors=True)
