"""The snapshotter service: directories follow the metadata, failures leave nothing behind."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from snapshotter.errors import AlreadyExists, FailedPrecondition, NotFound
from snapshotter.snapshots.model import Kind
from snapshotter.snapshots.service import Snapshotter, disk_usage


@pytest.fixture
def sn(tmp_path: Path) -> Snapshotter:
    return Snapshotter(tmp_path / "root")


def _dirs(sn: Snapshotter) -> set[str]:
    return set(os.listdir(sn.snapshots_dir))


def test_prepare_commit_prepare_gives_overlay(sn: Snapshotter) -> None:
    (m,) = sn.prepare("a", "", {})
    assert m.type == "bind"
    Path(m.source, "file").write_bytes(b"x" * 10000)
    sn.commit("base", "a", {"l": "v"})
    (m2,) = sn.prepare("b", "base", {})
    base_id = sn.snapshot("base").id
    assert m2.type == "overlay"
    assert f"lowerdir={sn.fs_dir(base_id)}" in m2.options
    assert sn.mounts("b") == [m2]
    assert sn.stat("base").labels == {"l": "v"}
    usage = sn.usage("base")
    assert usage.size >= 10000 and usage.inodes == 2


def test_usage_of_active_is_live(sn: Snapshotter) -> None:
    (m,) = sn.prepare("a", "", {})
    before = sn.usage("a")
    Path(m.source, "d").mkdir()
    Path(m.source, "d", "f").write_bytes(os.urandom(100_000))
    os.link(Path(m.source, "d", "f"), Path(m.source, "hard"))
    after = sn.usage("a")
    assert after.inodes == before.inodes + 2  # the hard link is not counted twice
    assert after.size >= before.size + 100_000


def test_remove_deletes_dir_only_after_metadata(sn: Snapshotter) -> None:
    sn.prepare("a", "", {})
    sid = sn.snapshot("a").id
    sn.remove("a")
    assert sid not in _dirs(sn)
    with pytest.raises(NotFound):
        sn.stat("a")


def test_failed_prepare_leaves_no_directory(sn: Snapshotter) -> None:
    sn.prepare("a", "", {})
    before = _dirs(sn)
    with pytest.raises(AlreadyExists):
        sn.prepare("a", "", {})
    with pytest.raises(NotFound):
        sn.prepare("b", "missing", {})
    assert _dirs(sn) == before


def test_failed_remove_keeps_directory_and_metadata(sn: Snapshotter) -> None:
    sn.prepare("a", "", {})
    sn.commit("base", "a", {})
    sn.prepare("child", "base", {})
    base_id = sn.snapshot("base").id
    with pytest.raises(FailedPrecondition):
        sn.remove("base")
    assert base_id in _dirs(sn)
    assert sn.stat("base").kind is Kind.COMMITTED


def test_commit_of_view_fails_and_keeps_it(sn: Snapshotter) -> None:
    sn.prepare("a", "", {})
    sn.commit("base", "a", {})
    sn.view("v", "base", {})
    with pytest.raises(FailedPrecondition):
        sn.commit("c", "v", {})
    assert sn.stat("v").kind is Kind.VIEW


def test_crash_between_rename_and_commit_is_cleaned_up(sn: Snapshotter) -> None:
    """A directory renamed in but whose transaction never committed is found by Cleanup."""
    real_rename = os.rename

    def rename_then_crash(src: object, dst: object) -> None:
        real_rename(src, dst)  # type: ignore[arg-type]
        raise KeyboardInterrupt("simulated crash before COMMIT")

    with mock.patch("snapshotter.snapshots.service.os.rename", rename_then_crash), \
            mock.patch("snapshotter.snapshots.service.shutil.rmtree"):
        with pytest.raises(KeyboardInterrupt):
            sn.prepare("a", "", {})
    leftovers = _dirs(sn)
    assert leftovers, "the simulated crash should leave a directory behind"
    assert list(sn.walk()) == []
    assert sorted(sn.cleanup()) == sorted(leftovers)
    assert _dirs(sn) == set()
    sn.prepare("a", "", {})  # the id may be reused; the stale dir must not get in the way
    assert Path(sn.fs_dir(sn.snapshot("a").id)).is_dir()


def test_cleanup_removes_only_unowned(sn: Snapshotter) -> None:
    sn.prepare("a", "", {})
    (sn.snapshots_dir / "rm-77").mkdir()
    (sn.snapshots_dir / "new-abc").mkdir()
    (sn.snapshots_dir / "999").mkdir()
    assert sorted(sn.cleanup()) == ["999", "new-abc", "rm-77"]
    assert _dirs(sn) == {sn.snapshot("a").id}


def test_walk_filters(sn: Snapshotter) -> None:
    sn.prepare("a", "", {"x": "1"})
    sn.commit("base", "a", {"containerd.io/snapshot.ref": "sha256:1"})
    sn.prepare("b", "base", {})
    assert [i.name for i in sn.walk(["kind==active"])] == ["b"]
    assert [i.name for i in sn.walk(['labels."containerd.io/snapshot.ref"==sha256:1,parent==""'])] == ["base"]
    assert sorted(i.name for i in sn.walk()) == ["b", "base"]


def test_disk_usage_missing_dir(tmp_path: Path) -> None:
    assert disk_usage(tmp_path / "nope").inodes == 0


def test_create_remote_is_committed_and_usable_as_parent(sn: Snapshotter) -> None:
    sn.prepare("a", "", {})
    sn.commit("base", "a", {})
    remote = sn.create_remote("chain-2", "base", {"containerd.io/snapshot/remote": "lazy"})
    info = sn.stat("chain-2")
    assert info.kind is Kind.COMMITTED and info.parent == "base"
    assert remote.parent_ids == (sn.snapshot("base").id,)
    assert Path(sn.fs_dir(remote.id)).is_dir()
    (m,) = sn.prepare("ctr", "chain-2", {})
    assert m.type == "overlay"
    with pytest.raises(AlreadyExists):
        sn.create_remote("chain-2", "base", {})
    assert _dirs(sn) == {sn.snapshot(k).id for k in ("base", "chain-2", "ctr")}
