"""The on-disk chunk store shared by the daemon and every mount process of a node.

Layout under ROOT:
  chunks/ALGO/ab/abcdef...     one file per chunk (uncompressed bytes), see `keys.relative_path`
  chunks/.../.tmp.PID.RANDOM   a write in progress (same dir as its target, so rename is atomic)
  index.db                     SQLite (WAL): chunks(key, size, atime), usage counters, pins

Invariants (across processes; all index changes run in `BEGIN IMMEDIATE` transactions):
- A chunk is served only if it has an index row AND its file has the recorded size (when it was
  opened: a file `get` keeps open serves its unchanged bytes after an eviction, see open_files). Files are
  written to a temp name and `os.replace`d into place inside the same write transaction that
  inserts the row, so a crash mid-write leaves only a temp file (never served, not counted,
  removed by `repair`), and eviction (which unlinks inside its transaction) cannot interleave
  with a commit.
- `usage()` is the sum of the rows, kept by triggers in a one-row table: O(1), no tree walk.
- Hard cap: a put makes room (evicting least recently used, unpinned chunks) in the same
  transaction that commits it; when it cannot, it stores nothing and returns False. Committed
  bytes never exceed `max_bytes` (temp files of writes in progress are outside the count).
- LRU is approximate: `get` (and `warm`, for read-ahead) refreshes a row's atime only when it is
  older than `touch_interval`.
- Pins are rows (pid, process start time, key, count). Pins of processes that are gone (or whose
  pid was reused: the start time differs) are ignored and pruned.
- Rows whose file vanished (a crash between unlink and commit, an operator's rm) are dropped on
  the next `get`/`put` of that key; `repair()` reconciles the whole tree (run it at daemon start).

Every method but `get_resident` and `read_resident_into` blocks (disk + SQLite); async callers
run them in a worker thread (those two never wait: they serve a read of an open, page-cached
chunk file inline, or say no). One ChunkCache
may be used from several threads (a lock serializes its SQLite connection); after a fork the
child reopens its own connection.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from snapshotter.cache import procs
from snapshotter.cache.buffers import ReadBuffers
from snapshotter.cache.keys import relative_path
from snapshotter.cache.open_files import OpenChunk, OpenChunkFiles
from snapshotter.errors import CacheError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks(
    key TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    atime REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_atime ON chunks(atime);
CREATE TABLE IF NOT EXISTS usage(
    id INTEGER PRIMARY KEY CHECK (id = 0),
    bytes INTEGER NOT NULL,
    chunks INTEGER NOT NULL
);
INSERT OR IGNORE INTO usage(id, bytes, chunks) VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS chunks_count_insert AFTER INSERT ON chunks BEGIN
    UPDATE usage SET bytes = bytes + NEW.size, chunks = chunks + 1 WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS chunks_count_delete AFTER DELETE ON chunks BEGIN
    UPDATE usage SET bytes = bytes - OLD.size, chunks = chunks - 1 WHERE id = 0;
END;
CREATE TABLE IF NOT EXISTS pins(
    pid INTEGER NOT NULL,
    start TEXT NOT NULL,
    key TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (pid, start, key)
);
CREATE INDEX IF NOT EXISTS pins_by_key ON pins(key);
"""

_TMP_PREFIX = ".tmp."
_EVICT_BATCH = 256
# Whether preadv(..., RWF_NOWAIT) works here (Linux; off for good after a file system refuses it).
_NOWAIT_READS = hasattr(os, "RWF_NOWAIT")


def _no_nowait_reads() -> None:
    global _NOWAIT_READS
    _NOWAIT_READS = False


@dataclass(frozen=True, slots=True)
class CacheUsage:
    bytes: int
    chunks: int


@dataclass(frozen=True, slots=True)
class Removed:
    """What an eviction, GC or repair took away."""

    bytes: int = 0
    chunks: int = 0


@dataclass(frozen=True, slots=True)
class RepairReport:
    temp_files: int = 0
    orphan_files: int = 0
    missing_files: int = 0


_dev_null_fd: list[int] = []  # opened once, on first use
_dev_null_lock = threading.Lock()


def _dev_null() -> int:
    with _dev_null_lock:
        if not _dev_null_fd:
            _dev_null_fd.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
        return _dev_null_fd[0]


def _into_page_cache(fd: int, size: int) -> None:
    """Have the kernel read the file's first `size` bytes into the page cache, without copying
    them to this process (sendfile to /dev/null); falls back to fadvise(WILLNEED), which only
    starts the reads, where sendfile refuses."""
    null = _dev_null()
    offset = 0
    try:
        while offset < size:
            sent = os.sendfile(null, fd, offset, size - offset)
            if sent <= 0:
                return  # the file is shorter than recorded; the next get notices
            offset += sent
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_WILLNEED)


class ChunkCache:
    """A size-capped, content-addressed chunk store; see the module docstring for invariants."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int,
        *,
        touch_interval: float = 5.0,
        fsync: bool = False,
        busy_timeout: float = 30.0,
    ) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.touch_interval = touch_interval
        self.fsync = fsync
        self._busy_ms = int(busy_timeout * 1000)
        self._lock = threading.RLock()
        self._open_files = OpenChunkFiles()
        self._read_buffers = ReadBuffers()
        self._db: sqlite3.Connection | None = None
        self._db_pid = -1
        self._me: tuple[int, str] | None = None
        # Chunks and bytes this object evicted to make room (LRU), since it was made.
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        try:
            (self.root / "chunks").mkdir(parents=True, exist_ok=True)
            self._connect()
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(f"cannot open chunk cache at {self.root}: {exc}") from exc

    # -- connection and transactions ------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        pid = os.getpid()
        if self._db is not None and self._db_pid == pid:
            return self._db
        # After a fork the parent's connection must not be used (or closed) by the child.
        db = sqlite3.connect(
            self.root / "index.db",
            isolation_level=None,
            check_same_thread=False,
            timeout=self._busy_ms / 1000,
        )
        db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        self._set_wal(db)
        db.execute("PRAGMA synchronous = NORMAL")
        try:
            # executescript would commit a transaction opened with execute(): keep it in the script.
            db.executescript("BEGIN IMMEDIATE;\n" + _SCHEMA + "\nCOMMIT;")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            db.close()
            raise
        self._db, self._db_pid = db, pid
        self._me = None
        return db

    def _set_wal(self, db: sqlite3.Connection) -> None:
        """Switch the index to WAL. SQLite answers "database is locked" at once, without its busy
        handler, when processes opening a new cache switch it at the same time (a daemon and its
        spare mount process on a fresh node): retry that until busy_timeout."""
        deadline = time.monotonic() + self._busy_ms / 1000
        delay = 0.005
        while True:
            try:
                db.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                    db.close()
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE: takes the database's write lock up front)."""
        with self._lock:
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            else:
                db.execute("COMMIT")

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._connect()

    def close(self) -> None:
        self._open_files.clear()
        with self._lock:
            if self._db is not None and self._db_pid == os.getpid():
                self._db.close()
            self._db = None

    def __enter__(self) -> ChunkCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _identity(self) -> tuple[int, str]:
        pid = os.getpid()
        if self._me is None or self._me[0] != pid:
            self._me = (pid, procs.start_time(pid) or "")
        return self._me

    # -- paths ------------------------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        """Where the chunk `key` lives (whether or not it is cached). ValueError for bad keys."""
        return self.root / relative_path(key)

    # -- reads ------------------------------------------------------------------------------

    def get(self, key: str, offset: int = 0, size: int | None = None) -> bytes | None:
        """The chunk's bytes [offset, offset+size) (all of it by default, clipped to its end),
        or None if it is not cached. Refreshes its LRU position.

        The chunk's file stays open for the next get of the same key (see `open_files`): that
        one skips the index and may serve a chunk evicted meanwhile, whose bytes are unchanged."""
        if offset < 0 or (size is not None and size < 0):
            raise ValueError(f"bad range {offset}+{size}")
        try:
            held = self._hold(key)
            if held is None:
                return None
            try:
                want = max(0, min(held.size - offset, held.size if size is None else size))
                data = os.pread(held.fd, want, offset) if want else b""
            finally:
                self._open_files.checkin(held)
            if len(data) != want:
                self._open_files.drop(key)
                return None
            now = time.time()
            if self._refresh_due(held, now):
                self._refresh_atimes([key], now)
            return data
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: cannot read {key}: {exc}") from exc

    def get_resident(self, key: str, offset: int, size: int) -> memoryview | None:
        """The chunk's bytes [offset, offset+size) (clipped to its end) when this can be had
        without waiting: its file is open here already (no index query), the bytes are in the
        page cache (RWF_NOWAIT) and its LRU row needs no refresh. None otherwise (use `get`).
        Safe to call from an event loop thread. The view is of a pooled buffer (see
        `buffers.ReadBuffers`), reused only once nothing refers to it."""
        if not _NOWAIT_READS or offset < 0 or size < 0:
            return None
        held = self._open_files.checkout(key)
        if held is None:
            return None
        try:
            want = max(0, min(held.size - offset, size))
            view = self._read_buffers.take(want)
            return view if self._read_resident(held, offset, view) else None
        finally:
            self._open_files.checkin(held)

    def read_resident_into(self, key: str, offset: int, into: memoryview) -> bool:
        """Fill `into` with the chunk's bytes from `offset` on, under `get_resident`'s
        conditions; False (`into` partly written, maybe) when they do not hold or the chunk
        ends before `into` is full. Lets a read spanning chunks land in one buffer."""
        if not _NOWAIT_READS or offset < 0:
            return False
        held = self._open_files.checkout(key)
        if held is None:
            return False
        try:
            return offset + len(into) <= held.size and self._read_resident(held, offset, into)
        finally:
            self._open_files.checkin(held)

    def read_into(self, key: str, offset: int, into: memoryview) -> bool:
        """Fill `into` with the chunk's bytes from `offset` on, as `get` reads them (opening the
        file when it is not held, waiting for the disk, refreshing the LRU row); False when the
        chunk is not cached or ends before `into` is full (`into` partly written, maybe)."""
        if offset < 0:
            raise ValueError(f"bad offset {offset}")
        try:
            held = self._hold(key)
            if held is None:
                return False
            try:
                if offset + len(into) > held.size:
                    return False
                got = os.preadv(held.fd, [into], offset) if len(into) else 0
            finally:
                self._open_files.checkin(held)
            if got != len(into):
                self._open_files.drop(key)
                return False
            now = time.time()
            if self._refresh_due(held, now):
                self._refresh_atimes([key], now)
            return True
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: cannot read {key}: {exc}") from exc

    def _read_resident(self, held: OpenChunk, offset: int, into: memoryview) -> bool:
        if time.time() - held.touched >= self.touch_interval:
            return False
        if not len(into):
            return True
        try:
            return os.preadv(held.fd, [into], offset, os.RWF_NOWAIT) == len(into)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                _no_nowait_reads()
            return False

    def warm(self, keys: Iterable[str]) -> set[str]:
        """Read the cached ones of `keys` into the page cache and keep their files open for the
        `get`s that follow; returns the keys that are cached. Blocks until the disk has answered.

        The bytes go from the file to /dev/null in the kernel (sendfile), so they are not
        copied out: the cost is the disk read. Several threads warming different chunks at
        once keep the disk busy, which one reader going from one chunk file to the next does
        not (it waits for each file's first read before the next file's starts).

        Warming is a use: the LRU rows of the warmed chunks that are due a refresh get it here,
        in one transaction, so the reads that follow are served without waiting (`get_resident`
        leaves a chunk due a refresh to `get`, one write transaction per chunk)."""
        found: set[str] = set()
        now = time.time()
        stale: list[str] = []
        for key in keys:
            try:
                held = self._hold(key)
                if held is None:
                    continue
                try:
                    _into_page_cache(held.fd, held.size)
                    if self._refresh_due(held, now):
                        stale.append(key)
                finally:
                    self._open_files.checkin(held)
            except (sqlite3.Error, OSError) as exc:
                raise CacheError(f"chunk cache {self.root}: cannot read {key}: {exc}") from exc
            found.add(key)
        if stale:
            try:
                self._refresh_atimes(stale, now)
            except sqlite3.Error as exc:
                raise CacheError(f"chunk cache {self.root}: cannot refresh {len(stale)} chunks: {exc}") from exc
        return found

    def _refresh_due(self, held: OpenChunk, now: float) -> bool:
        """Whether the LRU row of `held`'s chunk is due a refresh (older than touch_interval);
        if so it counts as refreshed from `now` on: the caller writes the row (_refresh_atimes)."""
        if now - held.touched < self.touch_interval:
            return False
        held.touched = now
        return True

    def _refresh_atimes(self, keys: Sequence[str], now: float) -> None:
        """Move the rows of `keys` up the LRU to `now` (never back), in one transaction."""
        with self._write() as db:
            db.executemany("UPDATE chunks SET atime = ? WHERE key = ? AND atime < ?", [(now, k, now) for k in keys])

    def _hold(self, key: str) -> OpenChunk | None:
        """The chunk's file checked out of the open-file list, opened first if it is not held;
        None when it is not cached. Pair with `self._open_files.checkin`."""
        return self._open_files.checkout(key) or self._open(key)

    def _open(self, key: str) -> OpenChunk | None:
        """Open a chunk the index lists and whose file has the recorded size; None otherwise."""
        path = self.path_for(key)
        with self._read() as db:
            row = db.execute("SELECT size, atime FROM chunks WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        length, atime = row
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget_if_missing(key, path)
            return None
        try:
            if os.fstat(fd).st_size != length:
                # Only a damaged disk or an outside writer gets here; never serve it.
                os.close(fd)
                self.discard(key)
                return None
        except BaseException:
            os.close(fd)
            raise
        return self._open_files.adopt(key, fd, length, atime)

    def contains(self, key: str) -> bool:
        """Whether `key` has an index row (no file check, no LRU touch)."""
        return bool(self.present([key]))

    def present(self, keys: Iterable[str]) -> set[str]:
        """The subset of `keys` that the index holds (one query; no LRU touch)."""
        wanted = list(dict.fromkeys(keys))
        found: set[str] = set()
        try:
            with self._read() as db:
                for i in range(0, len(wanted), 500):
                    part = wanted[i:i + 500]
                    marks = ",".join("?" * len(part))
                    found.update(
                        r[0] for r in db.execute(f"SELECT key FROM chunks WHERE key IN ({marks})", part)
                    )
        except sqlite3.Error as exc:
            raise CacheError(f"chunk cache {self.root}: {exc}") from exc
        return found

    def usage(self) -> CacheUsage:
        """Committed bytes and chunks (O(1): counters kept by triggers)."""
        try:
            with self._read() as db:
                b, n = db.execute("SELECT bytes, chunks FROM usage WHERE id = 0").fetchone()
        except sqlite3.Error as exc:
            raise CacheError(f"chunk cache {self.root}: {exc}") from exc
        return CacheUsage(bytes=b, chunks=n)

    # -- writes -----------------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Store `data` as chunk `key` (the caller has verified it). True if it is now cached.

        False when it cannot fit: larger than max_bytes, or everything else is pinned.
        Storing a key that is already cached only refreshes its LRU position.
        """
        if len(data) > self.max_bytes:
            return False
        try:
            if self._refresh_existing(key, self.path_for(key)):
                return True
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: cannot store {key}: {exc}") from exc
        with self.writer(key) as w:
            w.write(data)
            return w.commit()

    def writer(self, key: str) -> ChunkWriter:
        """A store of chunk `key` whose bytes come in pieces (`ChunkWriter`); the caller verifies
        them before `commit`. Use it as a context manager: what is not committed is removed."""
        return ChunkWriter(self, key)

    def commit_all(self, writers: list[ChunkWriter], *, keep_open: bool = False) -> list[bool]:
        """`ChunkWriter.commit` of several writers of this cache in one index transaction (a
        run of small chunks costs one transaction, not one each). A CacheError leaves none of
        them committed; every writer is then aborted."""
        if not writers:
            return []
        now = time.time()
        try:
            for w in writers:
                w.flush()
            with self._write() as db:
                done = [w.commit_locked(db, now) for w in writers]
        except (sqlite3.Error, OSError) as exc:
            for w in writers:
                w.abort()
            keys = ", ".join(w.key for w in writers)
            raise CacheError(f"chunk cache {self.root}: cannot store {keys[:300]}: {exc}") from exc
        for w, ok in zip(writers, done, strict=True):
            if ok:
                w.finish_commit(now, keep_open=keep_open)
        return done

    def _refresh_existing(self, key: str, path: Path) -> bool:
        with self._read() as db:
            row = db.execute("SELECT atime FROM chunks WHERE key = ?", (key,)).fetchone()
        if row is None or not path.exists():
            return False
        if time.time() - row[0] >= self.touch_interval:
            with self._write() as db:
                db.execute("UPDATE chunks SET atime = ? WHERE key = ?", (time.time(), key))
        return True

    def _forget_if_missing(self, key: str, path: Path) -> None:
        with self._write() as db:
            # Re-check under the write lock: another process may have just stored it again.
            if not path.exists():
                db.execute("DELETE FROM chunks WHERE key = ?", (key,))

    def discard(self, key: str) -> bool:
        """Remove one chunk (e.g. found corrupt) regardless of pins; True if it was cached."""
        path = self.path_for(key)
        self._open_files.drop(key)
        try:
            with self._write() as db:
                gone = db.execute("DELETE FROM chunks WHERE key = ?", (key,)).rowcount > 0
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: cannot discard {key}: {exc}") from exc
        return gone

    def _make_room(self, db: sqlite3.Connection, need: int, limit: int, *, partial: bool = False) -> bool:
        """Inside a write transaction: evict LRU unpinned chunks until usage + need <= limit.

        Returns False, having evicted nothing, when pins make that impossible (unless `partial`:
        then it evicts what it can).
        """
        (used,) = db.execute("SELECT bytes FROM usage WHERE id = 0").fetchone()
        excess = used + need - limit
        if excess <= 0:
            return True
        if not partial and self._evictable(db) < excess:
            if not self._prune_pins_locked(db) or self._evictable(db) < excess:
                return False
        while excess > 0:
            victims = db.execute(
                "SELECT key, size FROM chunks WHERE key NOT IN (SELECT key FROM pins) ORDER BY atime LIMIT ?",
                (_EVICT_BATCH,),
            ).fetchall()
            if not victims:
                if partial and self._prune_pins_locked(db):
                    continue
                return False
            for key, size in victims:
                self._remove_locked(db, key)
                excess -= size
                self.evicted_chunks += 1
                self.evicted_bytes += size
                if excess <= 0:
                    break
        return True

    @staticmethod
    def _evictable(db: sqlite3.Connection) -> int:
        (n,) = db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM chunks WHERE key NOT IN (SELECT key FROM pins)"
        ).fetchone()
        return int(n)

    def _remove_locked(self, db: sqlite3.Connection, key: str) -> None:
        self._open_files.drop(key)
        db.execute("DELETE FROM chunks WHERE key = ?", (key,))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(key))

    def evict_to(self, limit: int) -> Removed:
        """Evict LRU unpinned chunks until usage <= limit (as far as pins allow)."""
        try:
            with self._write() as db:
                before = db.execute("SELECT bytes, chunks FROM usage WHERE id = 0").fetchone()
                self._make_room(db, 0, max(limit, 0), partial=True)
                after = db.execute("SELECT bytes, chunks FROM usage WHERE id = 0").fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: eviction failed: {exc}") from exc
        return Removed(bytes=before[0] - after[0], chunks=before[1] - after[1])

    def gc(self, referenced: Callable[[str], bool] | Container[str]) -> Removed:
        """Remove every unpinned chunk whose key `referenced` does not hold.

        `referenced` is a predicate or a container (e.g. the set of chunk keys of all live
        snapshots). It is called without the write lock held.
        """
        check: Callable[[str], bool]
        if isinstance(referenced, Container):
            check = referenced.__contains__
        else:
            check = referenced
        try:
            with self._read() as db:
                keys = [r[0] for r in db.execute("SELECT key FROM chunks")]
            doomed = [k for k in keys if not check(k)]
            freed = count = 0
            with self._write() as db:
                self._prune_pins_locked(db)
            for i in range(0, len(doomed), _EVICT_BATCH):
                with self._write() as db:
                    for key in doomed[i:i + _EVICT_BATCH]:
                        row = db.execute(
                            "SELECT size FROM chunks WHERE key = ? AND key NOT IN (SELECT key FROM pins)",
                            (key,),
                        ).fetchone()
                        if row is None:
                            continue
                        self._remove_locked(db, key)
                        freed += row[0]
                        count += 1
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: gc failed: {exc}") from exc
        return Removed(bytes=freed, chunks=count)

    # -- pins -------------------------------------------------------------------------------

    def pin(self, keys: Iterable[str]) -> None:
        """Protect `keys` from eviction and GC while this process lives (counted per key)."""
        pid, start = self._identity()
        rows = [(pid, start, k) for k in keys]
        with self._write() as db:
            db.executemany(
                "INSERT INTO pins(pid, start, key, count) VALUES (?, ?, ?, 1)"
                " ON CONFLICT(pid, start, key) DO UPDATE SET count = count + 1",
                rows,
            )

    def unpin(self, keys: Iterable[str]) -> None:
        """Undo one `pin` of each key by this process."""
        pid, start = self._identity()
        rows = [(pid, start, k) for k in keys]
        with self._write() as db:
            db.executemany("UPDATE pins SET count = count - 1 WHERE pid = ? AND start = ? AND key = ?", rows)
            db.execute("DELETE FROM pins WHERE count <= 0")

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        keys = list(keys)
        self.pin(keys)
        try:
            yield
        finally:
            self.unpin(keys)

    def pinned_keys(self) -> set[str]:
        """Keys pinned by live processes."""
        with self._write() as db:
            self._prune_pins_locked(db)
            return {r[0] for r in db.execute("SELECT DISTINCT key FROM pins")}

    def prune_pins(self) -> int:
        """Drop pins of processes that are gone; returns how many processes were pruned."""
        with self._write() as db:
            return self._prune_pins_locked(db)

    def _prune_pins_locked(self, db: sqlite3.Connection) -> int:
        owners = db.execute("SELECT DISTINCT pid, start FROM pins").fetchall()
        dead = [(pid, start) for pid, start in owners if not procs.is_alive(pid, start)]
        db.executemany("DELETE FROM pins WHERE pid = ? AND start = ?", dead)
        return len(dead)

    # -- maintenance ------------------------------------------------------------------------

    def repair(self, *, temp_grace: float = 3600.0) -> RepairReport:
        """Reconcile the tree with the index (walks the tree; run at daemon start).

        Removes temp files of dead writers (and any older than `temp_grace` seconds), files
        without an index row, and rows without a file.
        """
        temps = orphans = missing = 0
        now = time.time()
        try:
            with self._write() as db:
                known = {r[0]: r[1] for r in db.execute("SELECT key, size FROM chunks")}
                by_path = {relative_path(k).as_posix(): k for k in known}
                seen: set[str] = set()
                for dirpath, _dirs, files in os.walk(self.root / "chunks"):
                    for name in files:
                        full = Path(dirpath, name)
                        rel = full.relative_to(self.root).as_posix()
                        if name.startswith(_TMP_PREFIX):
                            if self._temp_is_stale(name, full, now, temp_grace):
                                with contextlib.suppress(FileNotFoundError):
                                    full.unlink()
                                temps += 1
                            continue
                        key = by_path.get(rel)
                        if key is None or full.stat().st_size != known[key]:
                            with contextlib.suppress(FileNotFoundError):
                                full.unlink()
                            if key is not None:
                                db.execute("DELETE FROM chunks WHERE key = ?", (key,))
                                missing += 1
                            else:
                                orphans += 1
                            continue
                        seen.add(key)
                gone = [k for k in known if k not in seen]
                for key in gone:
                    db.execute("DELETE FROM chunks WHERE key = ?", (key,))
                missing += len(gone)
                # Recompute the counters from the rows, in case the index was edited by hand.
                db.execute(
                    "UPDATE usage SET bytes = (SELECT COALESCE(SUM(size), 0) FROM chunks),"
                    " chunks = (SELECT COUNT(*) FROM chunks) WHERE id = 0"
                )
                self._prune_pins_locked(db)
        except (sqlite3.Error, OSError) as exc:
            raise CacheError(f"chunk cache {self.root}: repair failed: {exc}") from exc
        return RepairReport(temp_files=temps, orphan_files=orphans, missing_files=missing)

    @staticmethod
    def _temp_is_stale(name: str, full: Path, now: float, grace: float) -> bool:
        try:
            pid = int(name[len(_TMP_PREFIX):].split(".", 1)[0])
        except ValueError:
            return True
        if procs.start_time(pid) is None:
            return True
        try:
            return now - full.stat().st_mtime > grace
        except FileNotFoundError:
            return False


class ChunkWriter:
    """One chunk being written to the cache: `write` its bytes in order, then `commit()`, or
    `abort()` (leaving the with block does that unless committed). The bytes go to a temp file
    beside the chunk's place; nothing of them is served before the commit, which renames the
    file into place and inserts its row in one transaction (see the module docstring), making
    room by LRU eviction as `put` does. Blocking, like the rest of ChunkCache. CacheError (naming
    the key) for IO and index failures; the temp file is removed on every failure."""

    def __init__(self, cache: ChunkCache, key: str) -> None:
        self.cache = cache
        self.key = key
        self.size = 0
        self.committed = False
        self._path = cache.path_for(key)
        self._tmp: Path | None = None
        self._fd = -1

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def _error(self, exc: BaseException, doing: str) -> CacheError:
        self.abort()
        return CacheError(f"chunk cache {self.cache.root}: cannot {doing} {self.key}: {exc}")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            if self._fd < 0:
                self._tmp = self._path.parent / f"{_TMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}"
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                try:
                    self._fd = os.open(self._tmp, flags, 0o644)
                except FileNotFoundError:  # the chunk's directory is new (a stat per chunk costs more)
                    self._path.parent.mkdir(parents=True, exist_ok=True)
                    self._fd = os.open(self._tmp, flags, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            self.size += len(data)
        except OSError as exc:
            raise self._error(exc, "store") from exc

    def copy_from(self, fd: int, offset: int, size: int) -> None:
        """Append `size` bytes of open file `fd` from `offset`, copied by the kernel (no bytes
        pass through this process). CacheError also when `fd` ends before that."""
        try:
            if self._fd < 0:
                self.write(b"")
            done = 0
            while done < size:
                n = os.copy_file_range(fd, self._fd, size - done, offset + done)
                if n == 0:
                    raise OSError(errno.EIO, f"source ended {size - done} bytes early")
                done += n
            self.size += size
        except OSError as exc:
            raise self._error(exc, "store") from exc

    def read_back(self) -> bytes:
        """The bytes written so far (before `abort`; for a caller whose commit found no room)."""
        if self._fd < 0:
            return b""
        try:
            return os.pread(self._fd, self.size, 0)
        except OSError as exc:
            raise self._error(exc, "read back") from exc

    def commit(self, *, keep_open: bool = False) -> bool:
        """Make the written bytes chunk `key`. True when it is cached (also when another writer
        stored it first); False when it cannot fit (the bytes stay readable with `read_back`
        until `abort`). keep_open: the file joins the open chunk files (see `get`), for reads of
        it that are about to follow."""
        return self.cache.commit_all([self], keep_open=keep_open)[0]

    def flush(self) -> None:
        """Before the commit's transaction: the file exists (an empty chunk too) and is on disk
        when the cache fsyncs."""
        if self._fd < 0:
            self.write(b"")
        if self.cache.fsync:
            os.fsync(self._fd)

    def commit_locked(self, db: sqlite3.Connection, now: float) -> bool:
        """The commit inside the cache's write transaction (see `ChunkCache.commit_all`)."""
        cache = self.cache
        if self.size > cache.max_bytes:
            return False
        row = db.execute("SELECT size FROM chunks WHERE key = ?", (self.key,)).fetchone()
        if row is not None:
            if self._path.exists():
                db.execute("UPDATE chunks SET atime = ? WHERE key = ?", (now, self.key))
                self.abort()  # stored by another writer first
                return True
            db.execute("DELETE FROM chunks WHERE key = ?", (self.key,))
        if not cache._make_room(db, self.size, cache.max_bytes):
            return False
        assert self._tmp is not None
        os.replace(self._tmp, self._path)
        self._tmp = None
        db.execute("INSERT INTO chunks(key, size, atime) VALUES (?, ?, ?)", (self.key, self.size, now))
        return True

    def finish_commit(self, now: float, *, keep_open: bool) -> None:
        """After the transaction: keep the file open for reads (keep_open) or close it."""
        self.committed = True
        if keep_open and self._fd >= 0:
            fd, self._fd = self._fd, -1
            self.cache._open_files.checkin(self.cache._open_files.adopt(self.key, fd, self.size, now))
        else:
            self.abort()

    def abort(self) -> None:
        """Forget what was written (no effect after a commit)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._tmp is not None:
            tmp, self._tmp = self._tmp, None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
