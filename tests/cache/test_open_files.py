"""The open-file LRU behind ChunkCache.get: descriptors close only when unused and dropped, and a
held chunk keeps serving its bytes after another process evicts it."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from snapshotter.cache import ChunkCache
from snapshotter.cache.open_files import OpenChunkFiles
from tests.cache.helpers import chunk


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        assert exc.errno == errno.EBADF
        return False
    return True


def test_files_close_when_dropped_and_unused(tmp_path: Path) -> None:
    files = OpenChunkFiles(capacity=2)
    fds = []
    for i in range(3):
        p = tmp_path / str(i)
        p.write_bytes(b"x")
        fds.append(os.open(p, os.O_RDONLY))
    a = files.adopt("a", fds[0], 1, 0.0)  # checked out once
    files.checkin(files.adopt("b", fds[1], 1, 0.0))
    files.checkin(files.adopt("c", fds[2], 1, 0.0))  # pushes "a" out of the LRU while in use
    assert len(files) == 2 and files.checkout("a") is None
    assert _is_open(fds[0]), "closed under a user"
    files.checkin(a)
    assert not _is_open(fds[0])
    b = files.checkout("b")
    assert b is not None and b.fd == fds[1]
    files.drop("b")
    assert _is_open(fds[1])
    files.checkin(b)
    assert not _is_open(fds[1])
    files.clear()
    assert not _is_open(fds[2]) and len(files) == 0



def test_held_bytes_are_bounded_as_well_as_the_count(tmp_path: Path) -> None:
    files = OpenChunkFiles(capacity=10, max_bytes=100)
    for i in range(4):
        p = tmp_path / str(i)
        p.write_bytes(b"x" * 40)
        files.checkin(files.adopt(str(i), os.open(p, os.O_RDONLY), 40, 0.0))
    held = [files.checkout(str(i)) for i in range(4)]
    assert [h is not None for h in held] == [False, False, True, True]  # 2 x 40 bytes fit in 100, 3 would not
    for h in held:
        if h is not None:
            files.checkin(h)
    big = tmp_path / "big"
    big.write_bytes(b"y" * 500)
    files.checkin(files.adopt("big", os.open(big, os.O_RDONLY), 500, 0.0))
    assert len(files) == 1 and files.checkout("big") is not None  # one file over the bound stays alone


def test_held_chunk_survives_eviction_elsewhere_but_not_discard_here(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    other = ChunkCache(tmp_path, 1 << 20)  # as another process would
    key, data = chunk(1, 5000)
    assert cache.put(key, data)
    assert cache.get(key, 10, 100) == data[10:110]  # opens and holds the file
    assert other.evict_to(0).chunks == 1
    assert not cache.path_for(key).exists()
    assert cache.get(key, 0, 5000) == data  # the held file: same bytes
    assert cache.contains(key) is False
    cache.discard(key)
    assert cache.get(key) is None


def test_truncated_held_file_is_a_miss_not_short_data(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    key, data = chunk(2, 5000)
    assert cache.put(key, data) and cache.get(key, 0, 10) == data[:10]
    os.truncate(cache.path_for(key), 100)  # an outside writer damaging the file in place
    assert cache.get(key, 0, 5000) is None
    assert cache.get(key) is None  # reopened: the size check drops it
    assert not cache.contains(key)


def _resident_bytes(fd: int, size: int) -> int:
    """How many of the file's first `size` bytes a read gets from the page cache alone."""
    try:
        return os.preadv(fd, [bytearray(size)], 0, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0


def test_warm_reports_cached_keys_and_has_read_them_into_memory_when_it_returns(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to drop the page cache (the project runs tests as root)")
    cache = ChunkCache(tmp_path, 16 << 20)
    key, data = chunk(3, 4 << 20)
    missing, _ = chunk(4, 10)
    assert cache.put(key, data)
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")
    fd = os.open(cache.path_for(key), os.O_RDONLY)
    try:
        assert _resident_bytes(fd, len(data)) < len(data)
        assert cache.warm([key, missing]) == {key}
        # warm() waits for the disk: every byte is in memory now, no polling.
        assert _resident_bytes(fd, len(data)) == len(data)
    finally:
        os.close(fd)
    assert cache.get(key) == data


def _drop_page_cache() -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to drop the page cache (the project runs tests as root)")
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


def test_get_resident_serves_only_open_page_cached_chunks_without_waiting(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 16 << 20, touch_interval=3600)
    key, data = chunk(5, 1 << 20)
    assert cache.put(key, data)
    assert cache.get_resident(key, 0, 100) is None  # not open here yet: that needs the index
    assert cache.get(key, 0, 10) == data[:10]  # opens and holds the file
    got = cache.get_resident(key, 1000, 5000)
    assert got == data[1000:6000] and isinstance(got, memoryview)
    assert cache.get_resident(key, len(data) - 10, 100) == data[-10:]  # clipped to the chunk
    _drop_page_cache()
    assert cache.get_resident(key, 0, 4096) is None  # on disk only: the caller's thread reads it
    assert cache.get(key, 0, 4096) == data[:4096]
    assert cache.get_resident(key, 0, 4096) == data[:4096]
    os.truncate(cache.path_for(key), 100)  # an outside writer damaging the file in place
    assert cache.get_resident(key, 0, 4096) is None  # a short read is a miss, never short data


def test_read_resident_into_fills_a_slice_of_a_bigger_buffer_or_says_no(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 16 << 20, touch_interval=3600)
    a, data_a = chunk(7, 1 << 20)
    b, data_b = chunk(8, 1 << 20)
    assert cache.put(a, data_a) and cache.put(b, data_b)
    buf = bytearray(300_000)
    view = memoryview(buf)
    assert not cache.read_resident_into(a, 0, view[:10])  # not open here yet
    assert cache.get(a, 0, 1) == data_a[:1] and cache.get(b, 0, 1) == data_b[:1]
    # The end of one chunk and the start of the next, side by side in one buffer.
    assert cache.read_resident_into(a, len(data_a) - 100_000, view[:100_000])
    assert cache.read_resident_into(b, 0, view[100_000:])
    assert bytes(buf) == data_a[-100_000:] + data_b[:200_000]
    assert not cache.read_resident_into(a, len(data_a) - 10, view[:11]), "past the chunk's end"
    assert cache.read_resident_into(a, 5, view[:0])
    _drop_page_cache()
    assert not cache.read_resident_into(b, 0, view[:4096]), "on disk only"


def test_get_resident_leaves_the_lru_refresh_to_get(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 16 << 20, touch_interval=0.05)
    key, data = chunk(6, 4096)
    assert cache.put(key, data) and cache.get(key, 0, 1) == data[:1]
    assert cache.get_resident(key, 0, 10) == data[:10]
    time.sleep(0.06)
    assert cache.get_resident(key, 0, 10) is None  # due for an atime refresh: `get` does it
    assert cache.get(key, 0, 10) == data[:10]
    assert cache.get_resident(key, 0, 10) == data[:10]


def test_warm_is_a_use_it_refreshes_the_lru_rows_due_so_reads_after_it_need_no_thread(tmp_path: Path) -> None:
    """A sequential reader's chunks are warmed just before it reads them: warm() refreshes the
    LRU rows that are due (one transaction), so the reads are served inline (`get_resident`)
    instead of each going to `get` for its own write transaction."""
    import sqlite3

    cache = ChunkCache(tmp_path, 16 << 20, touch_interval=0.05)
    keys = []
    for i in range(3):
        key, data = chunk(20 + i, 4096)
        assert cache.put(key, data) and cache.get(key, 0, 1) == data[:1]
        keys.append(key)
    time.sleep(0.06)
    assert all(cache.get_resident(k, 0, 10) is None for k in keys), "due a refresh: left to get"
    before = time.time()
    assert cache.warm(keys) == set(keys)
    assert all(cache.get_resident(k, 0, 10) is not None for k in keys)
    with sqlite3.connect(tmp_path / "index.db") as db:
        atimes = [db.execute("SELECT atime FROM chunks WHERE key = ?", (k,)).fetchone()[0] for k in keys]
    assert min(atimes) >= before, "warm() did not refresh the rows"


def test_read_into_reads_from_the_disk_into_a_slice_and_says_no_for_what_is_not_there(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 16 << 20, touch_interval=3600)
    a, data_a = chunk(9, 1 << 20)
    assert cache.put(a, data_a)
    _drop_page_cache()
    buf = bytearray(200_000)
    view = memoryview(buf)
    assert not cache.read_resident_into(a, 0, view[:10]), "not open here yet"
    # Opens the file (the index says it is cached) and waits for the disk, as `get` does.
    assert cache.read_into(a, 1000, view[50_000:])
    assert bytes(buf[50_000:]) == data_a[1000:151_000]
    assert cache.read_resident_into(a, 1000, view[:10]), "the file is held open after it"
    assert not cache.read_into(a, len(data_a) - 10, view[:11]), "past the chunk's end"
    missing, _ = chunk(10, 4096)
    assert not cache.read_into(missing, 0, view[:10]), "not cached"
    os.truncate(cache.path_for(a), 100)  # an outside writer damaging the file in place
    assert not cache.read_into(a, 0, view[:4096]), "a short read is a miss, never short data"


def test_resident_reads_reuse_a_buffer_only_once_nothing_refers_to_it(tmp_path: Path) -> None:
    """A FUSE reply is a view of a pooled buffer: a view still held (by a caller or a buffer
    export) keeps its buffer out of the pool, and a released one is reused, not reallocated."""
    cache = ChunkCache(tmp_path, 1 << 20, touch_interval=3600)
    (k1, first), (k2, second) = chunk(1, 8192), chunk(2, 8192)
    for key, data in ((k1, first), (k2, second)):
        assert cache.put(key, data)
        assert cache.get(key) == data  # opens it here, so the reads below are served inline
    a = cache.get_resident(k1, 0, 4096)
    assert a is not None
    exported = memoryview(a)  # what PyObject_GetBuffer holds while pyfuse3 sends a reply
    del a
    b = cache.get_resident(k2, 0, 8192)
    assert b is not None and bytes(b) == second
    assert bytes(exported) == first[:4096], "a buffer still referred to was handed out again"
    held = id(b.obj)  # not the object: a reference here would keep it out of the pool
    del b
    c = cache.get_resident(k2, 4096, 4096)
    assert c is not None and id(c.obj) == held, "a released buffer is reused"
    assert bytes(c) == second[4096:]
    # Past the view, the buffer still holds what the previous read put there (a fresh,
    # zero-filled one would not): the reuse is not an allocator handing back the same address.
    assert bytes(memoryview(c.obj)[4096:8192]) == second[4096:]
    assert bytes(exported) == first[:4096]
