"""Case 6 of docs/faults.md: the chunk cache at its cap during heavy reads, and a full disk.

Own lab: the daemon's root is a 20 MiB tmpfs and the cache cap is 2 MiB.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.lab import Lab, mounts_under, wait_until
from tests.faults import imagekit
from tests.faults.conftest import (
    FaultLab,
    assert_cache_holds_only_verified_bytes,
    assert_metadata_consistent,
    cache_files,
    cleanup_rpc,
    fallback_line,
    fault_lab,
    file_cache_keys,
    gc_backend,
)

TMPFS_BYTES = 20 << 20
CACHE_CAP = 2 << 20


class TmpfsRootLab(Lab):
    """A Lab whose daemon root is a small tmpfs (unmounted by Lab.close with everything else)."""

    def _start_daemon(self) -> None:
        root = self.snapshotter_root
        root.mkdir(exist_ok=True)
        if str(root) not in mounts_under(root):
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(root)],
                           check=True, timeout=30)
        super()._start_daemon()


@pytest.fixture(scope="module")
def dlab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultLab]:
    with fault_lab(tmp_path_factory.mktemp("dlab"), cache_max=CACHE_CAP, lab_class=TmpfsRootLab) as fl:
        yield fl


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cache_usage(root: Path) -> tuple[int, int]:
    """(bytes the cache index counts, bytes of chunk files on disk)."""
    db = sqlite3.connect(f"file:{root / 'cache' / 'index.db'}?mode=ro", uri=True, timeout=10)
    try:
        counted = int(db.execute("SELECT bytes FROM usage WHERE id = 0").fetchone()[0])
    finally:
        db.close()
    return counted, sum(p.stat().st_size for p in cache_files(root).values())


def test_cache_at_cap_evicts_and_reads_keep_succeeding(dlab: FaultLab) -> None:
    files = imagekit.data_files(seed=61, count=5, size=1_000_000)  # 5 MB through a 2 MiB cache
    pushed = imagekit.push_lazy(dlab.registry, "cap", files)
    dlab.rpull(pushed.ref)
    assert fallback_line(dlab.daemon_log(), pushed.data_layer) is None
    names = " ".join(sorted(files))
    # Two passes: the second needs chunks the first pass's later files evicted.
    code, out = dlab.run(pushed.ref, "cap-read", "sh", "-c", f"sha256sum {names}; sha256sum {names}", timeout=120)
    assert code == 0, out
    sums = [line.split() for line in out.splitlines() if line.strip()]
    assert len(sums) == 10 and all(s == sha(files[n]) for s, n in sums), out
    counted, on_disk = _cache_usage(dlab.root)
    assert counted == on_disk <= CACHE_CAP, (counted, on_disk)
    # Each file's chunks are cached as one read unit (reader/units.py).
    total_units = sum(len(file_cache_keys(d)) for d in files.values())
    assert len(cache_files(dlab.root)) < total_units, "nothing was evicted"
    assert assert_cache_holds_only_verified_bytes(dlab.root, files) > 0
    # Each chunk was fetched at least once; evicted ones again on the second pass.
    assert len(dlab.proxy.seen(f"/blobs/{pushed.data_layer}")) > 2


def test_disk_full_gives_clear_errors_and_keeps_metadata_sound(dlab: FaultLab) -> None:
    lazy = imagekit.push_lazy(dlab.registry, "full-lazy", imagekit.data_files(seed=62, count=2, size=300_000))
    dlab.rpull(lazy.ref)
    other = dlab.root / "other-data"  # stands for whatever else an operator keeps on that disk
    other.write_bytes(b"\0" * (4 << 20))

    # 1. A plain layer bigger than the disk: containerd's unpack into our snapshot runs out of space.
    big = imagekit.images.deterministic_bytes(TMPFS_BYTES + (4 << 20), seed=63)
    raw = imagekit.tar_of({"/big.bin": big})
    layer = imagekit.LayerBlob(gzip.compress(raw, compresslevel=1, mtime=0), imagekit.sha256(raw))
    ref = imagekit.push_image(dlab.registry, "full-plain", [imagekit.busybox_layer(), layer])
    r = dlab.lab.ctr("images", "pull", "--plain-http", "--snapshotter", "lazy", ref, check=False, timeout=120)
    assert r.returncode != 0
    assert "no space left on device" in (r.stdout + r.stderr).lower(), r.stderr
    # containerd's Remove of the half-unpacked snapshot may fail too (SQLite cannot commit on a
    # full disk): then the row and its directory stay, and nothing is inconsistent.
    cleanup_rpc(dlab.lab)
    assert_metadata_consistent(dlab.root)
    # The operator frees space; containerd's GC removes what it no longer references.
    other.unlink()
    gc_backend(dlab.lab)
    cleanup_rpc(dlab.lab)
    assert_metadata_consistent(dlab.root)
    free = os.statvfs(dlab.root)
    assert free.f_bavail * free.f_frsize > TMPFS_BYTES // 2, "the failed unpack's space was not given back"

    # 2. The disk full while a running container reads a lazy file: the cache cannot store the
    #    chunks, the read still succeeds. (New containers cannot start then: Prepare fails clearly.)
    lab = dlab.lab
    result: list[subprocess.CompletedProcess[str]] = []
    script = "while [ ! -e /dev/shm/go ]; do sleep 0.1; done; sha256sum /data/f0"
    reader = threading.Thread(target=lambda: result.append(lab.ctr(
        "run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir", str(lab.dir / "fifo"),
        lazy.ref, "full-read", "sh", "-c", script, check=False, timeout=90)))
    reader.start()
    filler = dlab.root / "filler"
    try:
        wait_until("the reader container to run", lambda: "full-read" in lab.ctr("tasks", "ls").stdout, 30)
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        lab.ctr("tasks", "exec", "--exec-id", "go", "full-read", "touch", "/dev/shm/go", timeout=30)
        reader.join(60)
        assert not reader.is_alive()
        out = result[0].stdout
        assert out.split()[0] == sha(lazy.files["/data/f0"]), (out, result[0].stderr)
        logs = "".join(p.read_text(errors="replace") for p in dlab.root.glob("mounts/*/log"))
        assert "No space left on device" in logs or "database or disk is full" in logs, logs[-3000:]
        r = lab.ctr("snapshots", "--snapshotter", "lazy", "prepare", "full-probe", "", check=False)
        assert r.returncode != 0 and "database or disk is full" in r.stderr, r.stderr
        cleanup_rpc(lab)  # a failed Prepare may leave its new directory: Cleanup's job
        assert_metadata_consistent(dlab.root)
    finally:
        reader.join(60)
        filler.unlink(missing_ok=True)
        dlab.kill_tasks("full-read")
    dlab.lab.ctr("snapshots", "--snapshotter", "lazy", "rm", "full-probe", check=False)
    cleanup_rpc(dlab.lab)
    assert_metadata_consistent(dlab.root)
    assert_cache_holds_only_verified_bytes(dlab.root, lazy.files)
    # Space back: everything works again, also after a restart.
    code, out = dlab.run(lazy.ref, "full-after", "sha256sum", "/data/f1")
    assert code == 0 and out.split()[0] == sha(lazy.files["/data/f1"]), out
    dlab.restart_daemon()
    assert_metadata_consistent(dlab.root)
