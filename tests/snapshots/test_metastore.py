"""The SQLite metastore: containerd's rules, one transaction per operation."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from snapshotter.snapshots.metastore import MetaStore
from snapshotter.snapshots.model import Info, Kind, Usage


@pytest.fixture
def store(tmp_path: Path) -> MetaStore:
    return MetaStore(tmp_path / "meta.db")


def _chain(store: MetaStore) -> None:
    with store.transaction() as tx:
        tx.create(Kind.ACTIVE, "ns/1/a", "", {"l": "1"})
        tx.commit("ns/1/a", "base", {"c": "2"}, Usage(4096, 3))
        tx.create(Kind.ACTIVE, "ns/2/b", "base", {})
        tx.commit("ns/2/b", "mid", {}, Usage(10, 1))
        tx.create(Kind.ACTIVE, "ns/3/c", "mid", {})


def test_parent_chain_is_nearest_first(store: MetaStore) -> None:
    _chain(store)
    with store.transaction() as tx:
        base, mid, active = tx.snapshot_of("base"), tx.snapshot_of("mid"), tx.get_snapshot("ns/3/c")
    assert active.parent_ids == (mid.id, base.id)
    assert active.kind is Kind.ACTIVE
    assert len({base.id, mid.id, active.id}) == 3


def test_commit_keeps_id_replaces_key_and_labels(store: MetaStore) -> None:
    with store.transaction() as tx:
        created = tx.create(Kind.ACTIVE, "k", "", {"old": "x"})
        tx.commit("k", "name", {"new": "y"}, Usage(1, 1))
        committed = tx.snapshot_of("name")
        info = tx.stat("name")
    assert committed.id == created.id
    assert info.kind is Kind.COMMITTED and info.labels == {"new": "y"}
    with store.transaction() as tx, pytest.raises(NotFound):
        tx.stat("k")


def test_errors_follow_containerd(store: MetaStore) -> None:
    _chain(store)
    with store.transaction() as tx:
        tx.create(Kind.VIEW, "view", "base", {})
    cases = [
        (lambda tx: tx.stat("missing"), NotFound),
        (lambda tx: tx.create(Kind.ACTIVE, "ns/3/c", "", {}), AlreadyExists),
        (lambda tx: tx.create(Kind.ACTIVE, "base", "", {}), AlreadyExists),
        (lambda tx: tx.create(Kind.ACTIVE, "x", "nope", {}), NotFound),
        (lambda tx: tx.create(Kind.ACTIVE, "x", "ns/3/c", {}), InvalidArgument),
        (lambda tx: tx.create(Kind.COMMITTED, "x", "", {}), InvalidArgument),
        (lambda tx: tx.commit("view", "v2", {}, Usage(0, 0)), FailedPrecondition),
        (lambda tx: tx.commit("base", "b2", {}, Usage(0, 0)), FailedPrecondition),
        (lambda tx: tx.commit("ns/3/c", "mid", {}, Usage(0, 0)), AlreadyExists),
        (lambda tx: tx.remove("base"), FailedPrecondition),
        (lambda tx: tx.remove("missing"), NotFound),
        (lambda tx: tx.create(Kind.ACTIVE, "big", "", {"k": "v" * 5000}), InvalidArgument),
        (lambda tx: tx.get_snapshot("base"), FailedPrecondition),
    ]
    for op, error in cases:
        with pytest.raises(error), store.transaction() as tx:
            op(tx)
    with store.transaction() as tx:
        assert {i.name for i in tx.walk()} == {"base", "mid", "ns/3/c", "view"}


def test_failed_operation_rolls_back_whole_transaction(store: MetaStore) -> None:
    with pytest.raises(NotFound), store.transaction() as tx:
        tx.create(Kind.ACTIVE, "first", "", {})
        tx.create(Kind.ACTIVE, "second", "missing-parent", {})
    with store.transaction() as tx:
        assert list(tx.walk()) == []


def test_update_field_paths(store: MetaStore) -> None:
    with store.transaction() as tx:
        tx.create(Kind.ACTIVE, "k", "", {"a": "1", "b": "2"})
        before = tx.stat("k")
    def upd(labels: dict[str, str], paths: list[str]) -> Info:
        with store.transaction() as tx:
            return tx.update(Info("k", "", Kind.UNKNOWN, 0, 0, labels), paths)
    assert upd({"a": "9", "zzz": "ignored"}, ["labels.a"]).labels == {"a": "9", "b": "2"}
    assert upd({}, ["labels.b"]).labels == {"a": "9"}
    assert upd({"c": "3"}, ["labels"]).labels == {"c": "3"}
    after = upd({"d": "4"}, [])
    assert after.labels == {"d": "4"}
    assert after.updated_ns >= before.updated_ns and after.created_ns == before.created_ns
    with pytest.raises(InvalidArgument):
        upd({}, ["parent"])
    with pytest.raises(NotFound), store.transaction() as tx:
        tx.update(Info("nope", "", Kind.UNKNOWN, 0, 0, {}), [])


def test_remove_leaf_then_parent(store: MetaStore) -> None:
    _chain(store)
    with store.transaction() as tx:
        assert tx.children("mid") == ["ns/3/c"]
        tx.remove("ns/3/c")
        tx.remove("mid")
        tx.remove("base")
        assert tx.ids() == set()


def test_store_survives_reopen(tmp_path: Path) -> None:
    store = MetaStore(tmp_path / "m.db")
    _chain(store)
    store.close()
    again = MetaStore(tmp_path / "m.db")
    with again.transaction() as tx:
        assert tx.stat("mid").parent == "base"
        assert tx.usage("base")[2] == Usage(4096, 3)
