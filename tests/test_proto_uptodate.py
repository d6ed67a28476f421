"""The committed gRPC stubs are exactly what `python -m snapshotter.tools.genproto` makes from proto/."""

from __future__ import annotations

from pathlib import Path

from snapshotter.tools.genproto import OUT_DIR, generate


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts}


def test_generated_stubs_match_proto(tmp_path: Path) -> None:
    generate(tmp_path / "out")
    fresh, committed = _tree(tmp_path / "out"), _tree(OUT_DIR)
    assert fresh.keys() == committed.keys(), "run: .venv/bin/python -m snapshotter.tools.genproto"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stubs out of date ({stale}); run: .venv/bin/python -m snapshotter.tools.genproto"


def test_field_numbers_match_containerd() -> None:
    from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
    from snapshotter._proto.containerd.types import mount_pb2

    assert pb.DESCRIPTOR.package == "containerd.services.snapshots.v1"
    assert mount_pb2.DESCRIPTOR.package == "containerd.types"
    numbers = {f.name: f.number for f in pb.Info.DESCRIPTOR.fields}
    assert numbers == {"name": 1, "parent": 2, "kind": 3, "created_at": 4, "updated_at": 5, "labels": 6}
    assert {f.name: f.number for f in pb.UpdateSnapshotRequest.DESCRIPTOR.fields} == {
        "snapshotter": 1, "info": 2, "update_mask": 3}
    assert {f.name: f.number for f in mount_pb2.Mount.DESCRIPTOR.fields} == {
        "type": 1, "source": 2, "target": 3, "options": 4}
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["Snapshots"].methods] == [
        "Prepare", "View", "Mounts", "Commit", "Remove", "Stat", "Update", "List", "Usage", "Cleanup"]
