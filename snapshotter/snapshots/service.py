"""The snapshotter: containerd's snapshot semantics over directories under a root.

Layout under `root`:
    metadata.db                 SQLite metadata (see metastore.py)
    snapshots/ID/fs             the snapshot's files (upperdir for overlay)
    snapshots/ID/work           overlay workdir (active snapshots only)

Crash safety (as containerd's overlay snapshotter): a new snapshot's directory is built under a
temporary name (`new-*`), renamed to its id inside the metadata transaction, and removed again if
the transaction fails. A removed snapshot's directory is renamed to `rm-ID` inside the transaction
and deleted only after it commits. Whatever a crash leaves behind is a directory that no snapshot
owns, and `cleanup()` removes exactly those.

Lower layers are resolved through `lowers(snapshot)`, the seam where remote (lazily mounted)
layers slot in: by default each parent's lower dir is its own fs dir.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from snapshotter.errors import NotFound
from snapshotter.snapshots.filters import match_any, parse_filters
from snapshotter.snapshots.metastore import MetaStore, Transaction
from snapshotter.snapshots.model import Info, Kind, LowerDirs, Mount, Snapshot, Usage
from snapshotter.snapshots.mounts import compute_mounts

log = logging.getLogger(__name__)

_TEMP_PREFIXES = ("new-", "rm-")


def disk_usage(path: Path) -> Usage:
    """Bytes allocated (st_blocks * 512) and distinct inodes under `path`, not following links."""
    seen: set[tuple[int, int]] = set()
    size = 0
    stack = [str(path)]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Usage(0, 0)
    seen.add((st.st_dev, st.st_ino))
    size += st.st_blocks * 512
    while stack:
        current = stack.pop()
        try:
            it = os.scandir(current)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for entry in it:
                try:
                    est = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                ident = (est.st_dev, est.st_ino)
                if ident in seen:
                    continue
                seen.add(ident)
                size += est.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return Usage(size, len(seen))


def overlay_supports_index_off() -> bool:
    """containerd passes index=off when the overlay module knows the option."""
    return os.path.exists("/sys/module/overlay/parameters/index")


class Snapshotter:
    """containerd's snapshot operations over `root`. Thread-safe."""

    def __init__(self, root: Path, *, lowers: Callable[[Snapshot], LowerDirs] | None = None) -> None:
        self.root = root
        self.snapshots_dir = root / "snapshots"
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        self.store = MetaStore(root / "metadata.db")
        self._lowers = lowers or self.local_lowers
        # Directory renames and Cleanup's directory scan must not interleave.
        self._dirs_lock = threading.RLock()
        self._overlay_options: tuple[str, ...] = ("index=off",) if overlay_supports_index_off() else ()

    # -- paths ----------------------------------------------------------------------------------

    def fs_dir(self, snapshot_id: str) -> str:
        return str(self.snapshots_dir / snapshot_id / "fs")

    def work_dir(self, snapshot_id: str) -> str:
        return str(self.snapshots_dir / snapshot_id / "work")

    def local_lowers(self, snap: Snapshot) -> LowerDirs:
        """Each parent's own fs dir, nearest first (no remote layers)."""
        return LowerDirs(tuple(self.fs_dir(pid) for pid in snap.parent_ids))

    def set_lowers(self, lowers: Callable[[Snapshot], LowerDirs]) -> None:
        self._lowers = lowers

    def _mounts(self, snap: Snapshot) -> list[Mount]:
        lowers = self._lowers(snap)
        return compute_mounts(snap.kind, snap.id, lowers.dirs, upper_dir=self.fs_dir, work_dir=self.work_dir,
                              extra_options=self._overlay_options, data_dirs=lowers.data)

    # -- operations -----------------------------------------------------------------------------

    def prepare(self, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        return self._create(Kind.ACTIVE, key, parent, labels)

    def view(self, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        return self._create(Kind.VIEW, key, parent, labels)

    def _create(self, kind: Kind, key: str, parent: str, labels: Mapping[str, str]) -> list[Mount]:
        snap = self._insert_with_dir(lambda tx: tx.create(kind, key, parent, labels), work=kind is Kind.ACTIVE)
        return self._mounts(snap)

    def _insert_with_dir(self, insert: Callable[[Transaction], Snapshot], *, work: bool) -> Snapshot:
        """Build the snapshot's directory under a temp name, insert the record, rename the directory
        to the new id inside the same transaction; on any failure remove the directory again."""
        with self._dirs_lock:
            tmp = Path(tempfile.mkdtemp(prefix="new-", dir=self.snapshots_dir))
            try:
                os.chmod(tmp, 0o700)
                (tmp / "fs").mkdir(mode=0o755)
                if work:
                    (tmp / "work").mkdir(mode=0o711)
                with self.store.transaction() as tx:
                    snap = insert(tx)
                    if snap.parent_ids:
                        st = os.stat(self.fs_dir(snap.parent_ids[0]))
                        os.chown(tmp / "fs", st.st_uid, st.st_gid)
                    final = self.snapshots_dir / snap.id
                    if final.exists():  # left by a crash before an earlier transaction with this id committed
                        shutil.rmtree(final)
                    os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return snap

    def create_remote(self, name: str, parent: str, labels: Mapping[str, str]) -> Snapshot:
        """Record a committed snapshot whose files live elsewhere (a lazily mounted layer).

        Its fs dir exists (empty) so Cleanup, ownership and Usage work as for any snapshot.
        """
        return self._insert_with_dir(lambda tx: tx.create_committed(name, parent, labels), work=False)

    def mounts(self, key: str) -> list[Mount]:
        with self.store.transaction() as tx:
            snap = tx.get_snapshot(key)
        return self._mounts(snap)

    def commit(self, name: str, key: str, labels: Mapping[str, str]) -> None:
        with self.store.transaction() as tx:
            snap = tx.get_snapshot(key)
        usage = disk_usage(Path(self.fs_dir(snap.id)))
        with self.store.transaction() as tx:
            tx.commit(key, name, labels, usage)

    def remove(self, key: str) -> None:
        with self._dirs_lock:
            # The row goes first (committed), the directory after: a crash or a failed COMMIT
            # (disk full) in between leaves at worst a directory without a row, which Cleanup
            # removes; never a row whose directory Cleanup already took.
            with self.store.transaction() as tx:
                snapshot_id, _kind = tx.remove(key)
            src = self.snapshots_dir / snapshot_id
            doomed = self.snapshots_dir / f"rm-{snapshot_id}"
            try:
                os.rename(src, doomed)
            except FileNotFoundError:
                log.warning("event=remove_missing_dir key=%s id=%s", key, snapshot_id)
                return
            self._delete_dir(doomed)

    def stat(self, key: str) -> Info:
        with self.store.transaction() as tx:
            return tx.stat(key)

    def update(self, info: Info, paths: Sequence[str]) -> Info:
        with self.store.transaction() as tx:
            return tx.update(info, paths)

    def walk(self, filters: Sequence[str] = ()) -> Iterator[Info]:
        parsed = parse_filters(filters)
        with self.store.transaction() as tx:
            infos = list(tx.walk())
        return (i for i in infos if match_any(parsed, i.field))

    def usage(self, key: str) -> Usage:
        with self.store.transaction() as tx:
            info, snapshot_id, stored = tx.usage(key)
        if info.kind is Kind.ACTIVE:
            return disk_usage(Path(self.fs_dir(snapshot_id)))
        return stored

    def cleanup(self) -> list[str]:
        """Remove directories under snapshots/ that no snapshot owns; return their names."""
        removed: list[str] = []
        with self._dirs_lock:
            with self.store.transaction() as tx:
                owned = tx.ids()
            for entry in sorted(os.listdir(self.snapshots_dir)):
                if entry in owned:
                    continue
                self._delete_dir(self.snapshots_dir / entry)
                removed.append(entry)
        if removed:
            log.info("event=cleanup removed=%d dirs=%s", len(removed), ",".join(removed))
        return removed

    def snapshot(self, key: str) -> Snapshot:
        """Id, kind and parent ids of any snapshot (for the lazy side and tests)."""
        with self.store.transaction() as tx:
            return tx.snapshot_of(key)

    def infos_by_id(self, ids: Sequence[str]) -> list[Info]:
        """Info of each snapshot id, in the given order."""
        with self.store.transaction() as tx:
            return [tx.info_by_id(i) for i in ids]

    def users_of(self, snapshot_id: str) -> list[str]:
        """Active/view snapshots whose parent is `snapshot_id` (the containers of an image)."""
        with self.store.transaction() as tx:
            return tx.users_of(snapshot_id)

    def close(self) -> None:
        self.store.close()

    @staticmethod
    def _delete_dir(path: Path) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. something still mounted inside: Cleanup will retry
            log.warning("event=remove_dir_failed path=%s error=%s", path, exc)


__all__ = ["Snapshotter", "disk_usage", "NotFound"]
