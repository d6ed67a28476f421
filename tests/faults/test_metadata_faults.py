"""Metadata writes that fail at COMMIT (what a full disk does to SQLite), without a lab: the
snapshot's row and directory stay together, and the store keeps working (case 6 of
docs/faults.md, at unit level)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from snapshotter.snapshots.service import Snapshotter


class _FailingCommit:
    """Wraps the store's connection: the next COMMIT fails as on a full disk, not executed."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.armed = True

    def execute(self, sql: str, *args: Any) -> Any:
        if self.armed and sql.strip().upper() == "COMMIT":
            self.armed = False
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_remove_whose_commit_fails_keeps_the_row_and_its_directory(tmp_path: Path) -> None:
    sn = Snapshotter(tmp_path / "root")
    try:
        sn.prepare("a", "", {})
        sid = sn.snapshot("a").id
        (sn.snapshots_dir / sid / "fs" / "data").write_text("precious")
        real = sn.store._conn
        sn.store._conn = _FailingCommit(real)  # type: ignore[assignment]
        with pytest.raises(sqlite3.OperationalError):
            sn.remove("a")
        sn.store._conn = real
        assert sn.snapshot("a").id == sid, "the row is still there"
        assert (sn.snapshots_dir / sid / "fs" / "data").read_text() == "precious"
        assert sid not in sn.cleanup(), "Cleanup must not take a live snapshot's directory"
        assert not real.in_transaction, "the failed COMMIT left the transaction open"
        # The store keeps working: the retried Remove succeeds and takes the directory.
        sn.remove("a")
        assert not (sn.snapshots_dir / sid).exists()
        sn.prepare("b", "", {})
    finally:
        sn.close()
