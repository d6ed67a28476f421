"""Snapshot metadata in SQLite, with containerd's storage semantics.

One `MetaStore` per root. Every operation is one write transaction (`BEGIN IMMEDIATE`), so
concurrent callers (gRPC worker threads, a second process) serialize and a crash mid-operation
leaves the database as it was before it. The store knows nothing about directories: the service
creates directories before a transaction and removes them only after it commits.

Rules enforced here (containerd `snapshots/storage/bolt.go`):
- keys are unique across all kinds (active, view, committed);
- a parent must exist (NOT_FOUND) and be committed (INVALID_ARGUMENT);
- only active snapshots commit (FAILED_PRECONDITION), to a name not taken (ALREADY_EXISTS);
  the committed snapshot keeps the active one's id;
- a snapshot with children cannot be removed (FAILED_PRECONDITION);
- Update changes labels only: paths "labels" and "labels.KEY" (others: INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from snapshotter.snapshots.model import Info, Kind, Snapshot, Usage

MAX_LABEL_BYTES = 4096  # containerd: key + value of one label

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT NOT NULL UNIQUE,
    kind        INTEGER NOT NULL,
    parent      INTEGER REFERENCES snapshots(id),
    created_ns  INTEGER NOT NULL,
    updated_ns  INTEGER NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    size        INTEGER NOT NULL DEFAULT 0,
    inodes      INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent);
"""


def validate_labels(labels: Mapping[str, str]) -> None:
    """Raise InvalidArgument for a label whose key + value exceed containerd's 4096 bytes."""
    for k, v in labels.items():
        if len(k.encode()) + len(v.encode()) > MAX_LABEL_BYTES:
            raise InvalidArgument(f"label {k!r}: key and value exceed {MAX_LABEL_BYTES} bytes")


def _now_ns() -> int:
    return time.time_ns()


class Transaction:
    """Operations inside one SQLite transaction. Obtain from `MetaStore.transaction()`."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._c = conn

    # -- reads --------------------------------------------------------------------------------

    def _row(self, key: str) -> sqlite3.Row:
        row = self._c.execute("SELECT * FROM snapshots WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        return row

    def _info(self, row: sqlite3.Row) -> Info:
        parent = ""
        if row["parent"] is not None:
            prow = self._c.execute("SELECT key FROM snapshots WHERE id = ?", (row["parent"],)).fetchone()
            parent = prow["key"] if prow else ""
        return Info(row["key"], parent, Kind(row["kind"]), row["created_ns"], row["updated_ns"],
                    json.loads(row["labels"]))

    def _parent_ids(self, parent: int | None) -> tuple[str, ...]:
        ids: list[str] = []
        seen: set[int] = set()
        while parent is not None:
            if parent in seen:
                raise FailedPrecondition(f"parent chain of snapshot id {parent} loops")
            seen.add(parent)
            ids.append(str(parent))
            row = self._c.execute("SELECT parent FROM snapshots WHERE id = ?", (parent,)).fetchone()
            if row is None:
                raise NotFound(f"missing parent id {parent}")
            parent = row["parent"]
        return tuple(ids)

    def stat(self, key: str) -> Info:
        return self._info(self._row(key))

    def get_snapshot(self, key: str) -> Snapshot:
        """The id and parent ids of an active or view snapshot (FAILED_PRECONDITION otherwise)."""
        row = self._row(key)
        kind = Kind(row["kind"])
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise FailedPrecondition(f"snapshot {key!r} is {kind.label}, not active or view")
        return Snapshot(str(row["id"]), kind, self._parent_ids(row["parent"]))

    def snapshot_of(self, key: str) -> Snapshot:
        """The id and parent ids of any snapshot."""
        row = self._row(key)
        return Snapshot(str(row["id"]), Kind(row["kind"]), self._parent_ids(row["parent"]))

    def usage(self, key: str) -> tuple[Info, str, Usage]:
        row = self._row(key)
        return self._info(row), str(row["id"]), Usage(row["size"], row["inodes"])

    def walk(self) -> Iterator[Info]:
        for row in self._c.execute("SELECT * FROM snapshots ORDER BY id").fetchall():
            yield self._info(row)

    def info_by_id(self, snapshot_id: str) -> Info:
        row = self._c.execute("SELECT * FROM snapshots WHERE id = ?", (int(snapshot_id),)).fetchone()
        if row is None:
            raise NotFound(f"snapshot id {snapshot_id} does not exist")
        return self._info(row)

    def users_of(self, parent_id: str) -> list[str]:
        """Keys of active and view snapshots directly on top of snapshot id `parent_id`."""
        rows = self._c.execute("SELECT key FROM snapshots WHERE parent = ? AND kind IN (?, ?)",
                               (int(parent_id), int(Kind.ACTIVE), int(Kind.VIEW)))
        return [r["key"] for r in rows]

    def ids(self) -> set[str]:
        return {str(r["id"]) for r in self._c.execute("SELECT id FROM snapshots")}

    def children(self, key: str) -> list[str]:
        row = self._row(key)
        return [r["key"] for r in self._c.execute("SELECT key FROM snapshots WHERE parent = ?", (row["id"],))]

    # -- writes -------------------------------------------------------------------------------

    def create(self, kind: Kind, key: str, parent: str, labels: Mapping[str, str]) -> Snapshot:
        """Insert an active or view snapshot; return its id and parent chain."""
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise InvalidArgument(f"snapshot kind {kind.label} cannot be created; only active or view")
        if not key:
            raise InvalidArgument("snapshot key must not be empty")
        validate_labels(labels)
        parent_id: int | None = None
        if parent:
            prow = self._c.execute("SELECT id, kind FROM snapshots WHERE key = ?", (parent,)).fetchone()
            if prow is None:
                raise NotFound(f"parent snapshot {parent!r} does not exist")
            if Kind(prow["kind"]) is not Kind.COMMITTED:
                raise InvalidArgument(f"parent {parent!r} is not a committed snapshot")
            parent_id = prow["id"]
        if self._c.execute("SELECT 1 FROM snapshots WHERE key = ?", (key,)).fetchone():
            raise AlreadyExists(f"snapshot {key!r} already exists")
        now = _now_ns()
        cur = self._c.execute(
            "INSERT INTO snapshots (key, kind, parent, created_ns, updated_ns, labels) VALUES (?,?,?,?,?,?)",
            (key, int(kind), parent_id, now, now, json.dumps(dict(labels), sort_keys=True)),
        )
        assert cur.lastrowid is not None
        return Snapshot(str(cur.lastrowid), kind, self._parent_ids(parent_id))

    def create_committed(self, name: str, parent: str, labels: Mapping[str, str]) -> Snapshot:
        """Insert a committed snapshot directly (a remote layer: its files are not in its fs dir)."""
        snap = self.create(Kind.ACTIVE, name, parent, labels)
        self._c.execute("UPDATE snapshots SET kind = ? WHERE id = ?", (int(Kind.COMMITTED), int(snap.id)))
        return Snapshot(snap.id, Kind.COMMITTED, snap.parent_ids)

    def commit(self, key: str, name: str, labels: Mapping[str, str], usage: Usage) -> str:
        """Turn active `key` into committed `name` (same id); return the id."""
        validate_labels(labels)
        if not name:
            raise InvalidArgument("commit name must not be empty")
        if self._c.execute("SELECT 1 FROM snapshots WHERE key = ?", (name,)).fetchone():
            raise AlreadyExists(f"committed snapshot {name!r} already exists")
        row = self._row(key)
        if Kind(row["kind"]) is not Kind.ACTIVE:
            raise FailedPrecondition(f"snapshot {key!r} is {Kind(row['kind']).label}, not active")
        now = _now_ns()
        self._c.execute(
            "UPDATE snapshots SET key = ?, kind = ?, labels = ?, size = ?, inodes = ?, created_ns = ?,"
            " updated_ns = ? WHERE id = ?",
            (name, int(Kind.COMMITTED), json.dumps(dict(labels), sort_keys=True), usage.size, usage.inodes,
             now, now, row["id"]),
        )
        return str(row["id"])

    def remove(self, key: str) -> tuple[str, Kind]:
        """Delete `key` (no children allowed); return its id and kind."""
        row = self._row(key)
        if self._c.execute("SELECT 1 FROM snapshots WHERE parent = ? LIMIT 1", (row["id"],)).fetchone():
            raise FailedPrecondition(f"snapshot {key!r} has children; remove them first")
        self._c.execute("DELETE FROM snapshots WHERE id = ?", (row["id"],))
        return str(row["id"]), Kind(row["kind"])

    def update(self, info: Info, paths: Sequence[str]) -> Info:
        """Apply label changes from `info` selected by field paths; return the updated Info."""
        row = self._row(info.name)
        labels: dict[str, str] = json.loads(row["labels"])
        if not paths:
            labels = dict(info.labels)
        for path in paths:
            if path == "labels":
                labels = dict(info.labels)
            elif path.startswith("labels."):
                lkey = path[len("labels."):]
                if lkey in info.labels:
                    labels[lkey] = info.labels[lkey]
                else:
                    labels.pop(lkey, None)
            else:
                raise InvalidArgument(f"cannot update field {path!r} of snapshot {info.name!r}; "
                                      "only 'labels' and 'labels.KEY' are mutable")
        validate_labels(labels)
        self._c.execute("UPDATE snapshots SET labels = ?, updated_ns = ? WHERE id = ?",
                        (json.dumps(labels, sort_keys=True), _now_ns(), row["id"]))
        return self._info(self._row(info.name))


class MetaStore:
    """The SQLite database at `path` (WAL mode). Thread-safe; also safe across processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        with self._lock:
            self._conn.executescript(_SCHEMA)

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """One write transaction: committed when the block exits normally, rolled back on error."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield Transaction(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            try:
                self._conn.execute("COMMIT")
            except BaseException:
                # A failed COMMIT (disk full, I/O error) may leave the transaction open; the
                # next BEGIN would then fail forever.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()
