"""End to end with a real format: the corpus tar -> eStargz blob (our writer) -> footer + TOC ->
LayerIndex -> persisted index -> mount process -> the same tree GNU tar extracts from the tar."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from snapshotter.formats.index_codec import dump_index
from tests.formats.corpus import write_corpus_tar
from tests.formats.test_estargz import open_blob, write_blob
from tests.fusefs.layers import tree_facts
from tests.fusefs.mounting import layer_spec, mount_process


def _xattrs_we_compare(name: str) -> bool:
    # Not security.capability: the corpus's value is not a valid capability set, so tar cannot
    # set it and the kernel answers EINVAL when asked for it through any filesystem.
    return name.startswith("user.")


def test_estargz_layer_mounts_as_tar_extracts(tmp_path: Path) -> None:
    tar = write_corpus_tar(tmp_path / "layer.tar", big_size=3 << 20)
    blob = tmp_path / "layer.estargz"
    result = write_blob(tar, blob, chunk_size=256 << 10)
    _footer, index = open_blob(blob, result.digest)
    assert any(len(e.chunks) > 1 for e in index.regular_files())  # the big file spans chunks
    (tmp_path / "index.json").write_bytes(dump_index(index))

    # Reference: GNU tar's extraction, minus the whiteout/opaque files (which in a single layer
    # delete nothing and are never shown), keeping their parent's mtime.
    ref = tmp_path / "extracted"
    ref.mkdir()
    subprocess.run(["tar", "--xattrs", "--xattrs-include=user.*", "--numeric-owner", "-xpf", str(tar), "-C", str(ref)],
                   check=True, timeout=120)
    for marker in (ref / "data/.wh.deleted", ref / "opaque/.wh..wh..opq"):
        parent = os.stat(marker.parent)
        marker.unlink()
        os.utime(marker.parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))
    expected = tree_facts(ref, xattr_filter=_xattrs_we_compare)

    work = tmp_path / "mount"
    work.mkdir()
    spec = layer_spec(tmp_path / "index.json", {"kind": "file", "blob_path": str(blob)}, result.digest)
    with mount_process(work, [[spec]], subtrees=False) as m:
        got = tree_facts(m.mountpoint, xattr_filter=_xattrs_we_compare)
        assert got == expected
        assert os.lstat(m.mountpoint / "etc/passwd").st_ino == os.lstat(m.mountpoint / "etc/hardlink-to-passwd").st_ino
    assert m.proc.returncode == 0, m.log()
