"""All ten RPCs over the real unix socket, with containerd's status codes."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from google.protobuf import field_mask_pb2

from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from snapshotter.daemon import Daemon

TIMEOUT = 10


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value.code()  # type: ignore[attr-defined]


def _list(stub: pb_grpc.SnapshotsStub, *filters: str) -> list[pb.Info]:
    return [i for r in stub.List(pb.ListSnapshotsRequest(snapshotter="lazy", filters=list(filters)), timeout=TIMEOUT)
            for i in r.info]


def test_lifecycle(stub: pb_grpc.SnapshotsStub, daemon: Daemon) -> None:
    r = stub.Prepare(pb.PrepareSnapshotRequest(key="default/1/a", labels={"l": "1"}), timeout=TIMEOUT)
    (m,) = r.mounts
    assert m.type == "bind" and list(m.options) == ["rw", "rbind"]
    Path(m.source, "hello").write_text("hi")
    stub.Commit(pb.CommitSnapshotRequest(name="default/2/base", key="default/1/a", labels={"c": "2"}), timeout=TIMEOUT)
    info = stub.Stat(pb.StatSnapshotRequest(key="default/2/base"), timeout=TIMEOUT).info
    assert info.kind == pb.COMMITTED and dict(info.labels) == {"c": "2"} and info.created_at.seconds > 0

    r = stub.Prepare(pb.PrepareSnapshotRequest(key="default/3/b", parent="default/2/base"), timeout=TIMEOUT)
    (m,) = r.mounts
    assert m.type == "overlay" and any(o.startswith("lowerdir=") for o in m.options)
    assert stub.Mounts(pb.MountsRequest(key="default/3/b"), timeout=TIMEOUT).mounts[0] == m
    (v,) = stub.View(pb.ViewSnapshotRequest(key="default/4/v", parent="default/2/base"), timeout=TIMEOUT).mounts
    assert v.type == "bind" and "ro" in v.options and os.path.exists(os.path.join(v.source, "hello"))

    upd = stub.Update(pb.UpdateSnapshotRequest(
        info=pb.Info(name="default/2/base", labels={"new": "x"}),
        update_mask=field_mask_pb2.FieldMask(paths=["labels.new"])), timeout=TIMEOUT).info
    assert dict(upd.labels) == {"c": "2", "new": "x"}

    assert {i.name for i in _list(stub)} == {"default/2/base", "default/3/b", "default/4/v"}
    assert [i.name for i in _list(stub, "kind==view")] == ["default/4/v"]
    assert [i.name for i in _list(stub, "labels.new==x")] == ["default/2/base"]

    usage = stub.Usage(pb.UsageRequest(key="default/2/base"), timeout=TIMEOUT)
    assert usage.size > 0 and usage.inodes == 2

    stub.Remove(pb.RemoveSnapshotRequest(key="default/4/v"), timeout=TIMEOUT)
    stub.Remove(pb.RemoveSnapshotRequest(key="default/3/b"), timeout=TIMEOUT)
    snapdir = Path(daemon.config.root) / "snapshots"
    (snapdir / "orphan").mkdir()
    stub.Cleanup(pb.CleanupRequest(), timeout=TIMEOUT)
    assert not (snapdir / "orphan").exists()
    assert len(os.listdir(snapdir)) == 1


def test_error_codes(stub: pb_grpc.SnapshotsStub, daemon: Daemon) -> None:
    stub.Prepare(pb.PrepareSnapshotRequest(key="a"), timeout=TIMEOUT)
    stub.Commit(pb.CommitSnapshotRequest(name="base", key="a"), timeout=TIMEOUT)
    stub.Prepare(pb.PrepareSnapshotRequest(key="child", parent="base"), timeout=TIMEOUT)
    stub.View(pb.ViewSnapshotRequest(key="view", parent="base"), timeout=TIMEOUT)
    snapdir = Path(daemon.config.root) / "snapshots"
    before = sorted(os.listdir(snapdir))

    S = grpc.StatusCode
    assert _code(lambda: stub.Stat(pb.StatSnapshotRequest(key="nope"), timeout=TIMEOUT)) == S.NOT_FOUND
    assert _code(lambda: stub.Mounts(pb.MountsRequest(key="nope"), timeout=TIMEOUT)) == S.NOT_FOUND
    assert _code(lambda: stub.Usage(pb.UsageRequest(key="nope"), timeout=TIMEOUT)) == S.NOT_FOUND
    assert _code(lambda: stub.Remove(pb.RemoveSnapshotRequest(key="nope"), timeout=TIMEOUT)) == S.NOT_FOUND
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="child"), timeout=TIMEOUT)) == S.ALREADY_EXISTS
    assert _code(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="x", parent="nope"),
                                      timeout=TIMEOUT)) == S.NOT_FOUND
    assert _code(lambda: stub.Commit(pb.CommitSnapshotRequest(name="c2", key="view"),
                                     timeout=TIMEOUT)) == S.FAILED_PRECONDITION
    assert _code(lambda: stub.Remove(pb.RemoveSnapshotRequest(key="base"), timeout=TIMEOUT)) == S.FAILED_PRECONDITION
    assert _code(lambda: stub.Update(pb.UpdateSnapshotRequest(
        info=pb.Info(name="base"), update_mask=field_mask_pb2.FieldMask(paths=["kind"])),
        timeout=TIMEOUT)) == S.INVALID_ARGUMENT
    assert _code(lambda: _list(stub, "name==")) == S.INVALID_ARGUMENT

    # Nothing on disk or in metadata changed through the failed calls.
    assert sorted(os.listdir(snapdir)) == before
    assert {i.name for i in _list(stub)} == {"base", "child", "view"}


def test_socket_and_dir_modes(daemon: Daemon) -> None:
    sock = Path(daemon.config.address)
    assert sock.stat().st_mode & 0o777 == 0o660
    assert sock.parent.stat().st_mode & 0o777 == 0o700
    assert Path(daemon.config.root).stat().st_mode & 0o777 == 0o700
