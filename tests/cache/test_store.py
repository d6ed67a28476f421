"""ChunkCache: layout, cap + LRU, crash safety, dedup, pins, GC, several processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from snapshotter.cache import ChunkCache, blob_key
from snapshotter.errors import CacheError
from tests.cache.helpers import chunk, temp_files, tree_files, worker

REPO = Path(__file__).resolve().parents[2]


def wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.02)


@contextmanager
def child(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A helper process (tests/cache/helpers.py), SIGKILLed and reaped on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.cache.helpers", *args], cwd=REPO)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def assert_consistent(cache: ChunkCache) -> None:
    """usage() == the rows == the files on disk, every file's bytes match its key."""
    files = tree_files(cache.root)
    u = cache.usage()
    assert u.bytes == sum(files.values())
    assert u.chunks == len(files)
    assert u.bytes <= cache.max_bytes


def test_layout_roundtrip_and_dedup(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    key, data = chunk(1, 1000)
    assert cache.get(key) is None
    assert cache.put(key, data)
    hexd = key.split(":")[1]
    assert (tmp_path / "chunks" / "sha256" / hexd[:2] / hexd).read_bytes() == data
    assert cache.get(key) == data
    # The same content from another layer (or image) is stored once.
    assert cache.put(key, data)
    assert cache.usage().bytes == 1000 and cache.usage().chunks == 1
    # Digest-less chunks are keyed by their blob position.
    k2 = blob_key("sha256:" + "ab" * 32, 4096, 17, 5)
    assert cache.put(k2, b"hello") and cache.get(k2) == b"hello"
    assert cache.usage().chunks == 2
    assert_consistent(cache)


@pytest.mark.parametrize("bad", ["sha256:../../etc", "md5:" + "0" * 32, "sha256:" + "A" * 64, "x/y", ""])
def test_bad_keys_never_become_paths(tmp_path: Path, bad: str) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    with pytest.raises(ValueError):
        cache.put(bad, b"x")
    with pytest.raises(ValueError):
        cache.get(bad)


def test_cap_respected_reading_three_times_the_cap(tmp_path: Path) -> None:
    cap = 1 << 20
    size = 64 << 10
    cache = ChunkCache(tmp_path, cap, touch_interval=0)
    hot_key, hot = chunk(-1, size)
    assert cache.put(hot_key, hot)
    for i in range(3 * cap // size):
        key, data = chunk(i, size)
        if cache.get(key) is None:
            assert cache.put(key, data)
        assert cache.get(key) == data
        assert cache.get(hot_key) == hot  # kept recently used: LRU keeps it
        assert cache.usage().bytes <= cap
    assert cache.usage().bytes == cap  # full, never over
    assert_consistent(cache)
    # The oldest cold chunks were the ones evicted.
    assert cache.get(chunk(0, size)[0]) is None
    assert cache.get(chunk(3 * cap // size - 1, size)[0]) is not None
    assert cache.put(*chunk(99, cap + 1)) is False  # bigger than the cap: not stored
    assert_consistent(cache)


def test_evict_to_and_pins(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20, touch_interval=0)
    items = [chunk(i, 1000) for i in range(10)]
    for k, d in items:
        assert cache.put(k, d)
    cache.pin([items[0][0]])
    removed = cache.evict_to(0)
    assert removed.chunks == 9 and removed.bytes == 9000
    assert cache.get(items[0][0]) == items[0][1]
    assert cache.pinned_keys() == {items[0][0]}
    cache.unpin([items[0][0]])
    assert cache.evict_to(0).chunks == 1
    assert cache.usage().bytes == 0


def test_put_fails_cleanly_when_everything_is_pinned(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 3000, touch_interval=0)
    items = [chunk(i, 1000) for i in range(3)]
    for k, d in items:
        assert cache.put(k, d)
    with cache.pinned(k for k, _ in items):
        assert cache.put(*chunk(50, 1000)) is False
        assert {k for k, _ in items} <= {k for k, _ in items if cache.get(k)}
        assert_consistent(cache)
        assert temp_files(tmp_path) == []
    assert cache.put(*chunk(50, 1000)) is True
    assert_consistent(cache)


def test_pins_of_other_live_process_hold_and_of_dead_process_do_not(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20, touch_interval=0)
    key, data = chunk(7, 1000)
    assert cache.put(key, data)
    marker = tmp_path / "pinned"
    with child("pin", str(tmp_path), key, str(marker)) as proc:
        wait_for(marker)
        assert cache.evict_to(0).chunks == 0
        assert cache.get(key) == data
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert cache.evict_to(0).chunks == 1  # the dead process's pin is ignored
    assert cache.get(key) is None
    assert cache.pinned_keys() == set()


def test_gc_removes_unreferenced_unpinned(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    items = [chunk(i, 100) for i in range(6)]
    for k, d in items:
        cache.put(k, d)
    keep = {items[0][0], items[1][0]}
    cache.pin([items[2][0]])
    removed = cache.gc(keep)
    assert removed.chunks == 3 and removed.bytes == 300
    assert {k for k, _ in items if cache.get(k) is not None} == keep | {items[2][0]}
    cache.unpin([items[2][0]])
    assert cache.gc(lambda k: k == items[0][0]).chunks == 2
    assert cache.usage().chunks == 1
    assert_consistent(cache)


@pytest.mark.parametrize("mode", ["write", "replace"])
def test_sigkill_mid_write_never_serves_partial_chunk(tmp_path: Path, mode: str) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    base_key, base = chunk(1, 4096)
    cache.put(base_key, base)
    before = cache.usage()
    size = 16 << 20
    marker = tmp_path / "stalled"
    with child("slow-write", str(tmp_path), mode, str(marker), str(size)) as proc:
        wait_for(marker)
        key = marker.read_text()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    assert cache.get(key) is None
    assert cache.usage() == before
    if mode == "write":
        assert len(temp_files(tmp_path)) == 1
        assert temp_files(tmp_path)[0].stat().st_size < size
    # A fresh process reconciles the tree: the stale temp file / uncommitted file goes.
    fresh = ChunkCache(tmp_path, 1 << 30)
    report = fresh.repair()
    assert report.temp_files + report.orphan_files == 1
    assert temp_files(tmp_path) == []
    assert fresh.usage() == before
    assert_consistent(fresh)
    data = chunk(12345, size)[1]
    assert fresh.put(key, data) and fresh.get(key) == data


def test_missing_file_is_a_miss_and_heals(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    key, data = chunk(3, 500)
    cache.put(key, data)
    cache.path_for(key).unlink()  # an operator's rm, or a crash between unlink and commit
    assert cache.get(key) is None
    assert cache.usage().chunks == 0
    cache.path_for(key).parent.mkdir(parents=True, exist_ok=True)
    cache.path_for(key).write_bytes(data[:10])  # truncated file under a fresh row
    cache.put(key, data)
    assert cache.get(key) == data


def test_concurrent_processes_stay_consistent(tmp_path: Path) -> None:
    cap = 256 << 10
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        jobs = [pool.apply_async(worker, (str(tmp_path), cap, seed, 300, 24, 16 << 10)) for seed in range(4)]
        results = [j.get(timeout=120) for j in jobs]
    assert all(r["bad"] == 0 for r in results), results
    assert all(r["over_cap"] == 0 for r in results), results
    assert sum(r["hits"] for r in results) > 0
    cache = ChunkCache(tmp_path, cap)
    assert_consistent(cache)
    for path, _ in tree_files(tmp_path).items():
        import hashlib

        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name
    assert temp_files(tmp_path) == []
    assert cache.pinned_keys() == set()


def test_unwritable_root_raises_cache_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CacheError):
        ChunkCache(f, 100)


def test_fork_child_uses_its_own_connection(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    key, data = chunk(5, 100)
    cache.put(key, data)
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's sqlite connection
        code = 0 if cache.get(key) == data and cache.put(*chunk(6, 100)) else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.usage().chunks == 2


def test_writer_commits_pieces_and_leaves_nothing_before_or_after_failure(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    key, data = chunk(40, 100_000)
    with cache.writer(key) as w:
        for i in range(0, len(data), 30_000):
            w.write(memoryview(data)[i:i + 30_000])
        assert not cache.contains(key) and cache.get(key) is None  # nothing served before the commit
        assert len(temp_files(tmp_path)) == 1
        assert w.commit()
    assert cache.get(key) == data and temp_files(tmp_path) == []
    assert cache.usage().bytes == len(data)

    other, odata = chunk(41, 5000)
    with cache.writer(other) as w:
        w.write(odata[:100])  # abandoned: not committed
    assert not cache.contains(other) and temp_files(tmp_path) == []


def test_commit_all_is_one_transaction_and_no_room_gives_the_bytes_back(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 10_000)
    small = [chunk(50 + i, 3000) for i in range(3)]
    big_key, big = chunk(60, 20_000)  # over the cap
    writers = [cache.writer(k) for k, _ in small] + [cache.writer(big_key)]
    for w, (_, d) in zip(writers, [*small, (big_key, big)], strict=True):
        w.write(d)
    assert cache.commit_all(writers, keep_open=True) == [True, True, True, False]
    for k, d in small:
        assert cache.get_resident(k, 0, 10) == d[:10]  # kept open: served without the index
    assert writers[-1].read_back() == big
    writers[-1].abort()
    assert temp_files(tmp_path) == [] and cache.usage().chunks == 3

    k0, d0 = small[0]
    again = cache.writer(k0)
    again.write(d0)
    assert again.commit()  # another writer stored it first: still cached, nothing left over
    assert temp_files(tmp_path) == [] and cache.usage().chunks == 3


def test_processes_creating_one_cache_at_once_all_open_it(tmp_path: Path) -> None:
    """A daemon and its spare mount process open a node's new cache together: SQLite refused
    the switch to WAL with "database is locked" (without waiting) to all but one of them."""
    from tests.cache.helpers import open_and_close

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(6) as pool:
        for round_no in range(15):
            root = str(tmp_path / f"c{round_no}")
            jobs = [pool.apply_async(open_and_close, (root,)) for _ in range(6)]
            assert all(j.get(timeout=60) for j in jobs)


def test_a_writer_copies_from_an_open_file(tmp_path: Path) -> None:
    """ChunkWriter.copy_from appends a range of another file; a source that ends early stores
    nothing and leaves no temp file."""
    cache = ChunkCache(tmp_path / "c", 1 << 20)
    src = tmp_path / "src"
    src.write_bytes(b"0123456789" * 100)
    key = "sha256:" + "a" * 64  # the cache stores what it is given: the caller verifies
    fd = os.open(src, os.O_RDONLY)
    try:
        with cache.writer(key) as w:
            w.write(b"head")
            w.copy_from(fd, 3, 100)
            assert w.commit()
        assert cache.get(key) == b"head" + (b"0123456789" * 100)[3:103]
        other = "sha256:" + "b" * 64
        with cache.writer(other) as w, pytest.raises(CacheError, match="early"):
            w.copy_from(fd, 990, 20)
    finally:
        os.close(fd)
    assert not cache.contains(other) and temp_files(tmp_path / "c") == []
