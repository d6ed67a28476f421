"""snapshotter/record.py without containerd: the profile it writes and the mounts it parses
(the end-to-end run is tests/integration/test_prefetch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotter.convert import read_prefetch_list
from snapshotter.errors import SnapshotterError
from snapshotter.record import lowerdirs_of, profile_paths, write_profile


def test_profile_uses_entry_names_in_first_read_order_without_duplicates(tmp_path: Path) -> None:
    record = {"files": [
        {"path": "0/bin/busybox", "layer": 0, "name": "bin/busybox"},
        {"path": "1/app/f03", "layer": 2, "name": "app/f03"},
        {"path": "0/etc/hosts", "layer": 1, "name": None},       # no name: the path minus its run dir
        {"path": "1/app/link-to-f03", "layer": 2, "name": "app/f03"},  # a hard link: its file, once
    ]}
    paths = profile_paths(record)
    assert paths == ["/bin/busybox", "/app/f03", "/etc/hosts"]
    out = tmp_path / "profile.txt"
    write_profile(paths, out)
    assert read_prefetch_list(out) == ["bin/busybox", "app/f03", "etc/hosts"]  # what convert reads


def test_bad_record_document_is_an_error() -> None:
    with pytest.raises(SnapshotterError):
        profile_paths({"nope": []})


def test_lowerdirs_of_ctr_snapshot_mounts_output() -> None:
    text = ("mount -t overlay overlay /x -o index=off,workdir=/r/snapshots/9/work,upperdir=/r/snapshots/9/fs,"
            "lowerdir=/r/mounts/7/mnt/1:/r/snapshots/4/fs:/r/mounts/7/mnt/0\n")
    assert lowerdirs_of(text) == ["/r/mounts/7/mnt/1", "/r/snapshots/4/fs", "/r/mounts/7/mnt/0"]
    assert lowerdirs_of("mount -t bind /r/snapshots/1/fs /x -o rbind,ro\n") == []
    # Over a metadata image: its run dirs are the lowerdirs; the FUSE mount after "::" is data only.
    text = ("mount -t overlay overlay /x -o index=off,metacopy=on,"
            "lowerdir=/r/mounts/7/meta/1:/r/snapshots/4/fs:/r/mounts/7/meta/0::/r/mounts/7/mnt\n")
    assert lowerdirs_of(text) == ["/r/mounts/7/meta/1", "/r/snapshots/4/fs", "/r/mounts/7/meta/0"]
