"""remote/metaimages.py: keys, mounting next to a mount, prune, damaged images, turning off.

Real images (written by fusefs/metamount.py) and real erofs mounts (root; CI runs as root)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from snapshotter.formats.index_codec import dump_index
from snapshotter.fusefs.metamount import build_image, sources_path
from snapshotter.mountinfo import is_mountpoint
from snapshotter.remote.metaimages import MetaImages, key_of
from tests.fusefs.layers import Layer


def _state(tmp: Path) -> tuple[Path, dict[str, Any]]:
    index = Layer().dir("etc").file("etc/hostname", b"box\n").symlink("etc/link", "hostname").build(tmp / "blob")
    (tmp / "index.bin").write_bytes(dump_index(index))
    doc = {"mountpoint": str(tmp / "mnt"), "bare_runs": [0],
           "runs": [[{"index": str(tmp / "index.bin"), "layer_digest": "sha256:" + "a" * 64,
                      "reader": {"kind": "file", "blob_path": str(tmp / "blob")}}]]}
    (tmp / "state.json").write_text(json.dumps(doc))
    return tmp / "state.json", doc


def test_key_follows_what_the_tree_is_made_of(tmp_path: Path) -> None:
    _path, doc = _state(tmp_path)
    key = key_of(doc)
    assert key == key_of(json.loads(json.dumps(doc)))
    assert key == key_of({**doc, "meta_image": "/x", "fetch_timeout": 3})  # settings are not the tree
    assert key != key_of({**doc, "bare_runs": []})
    os.utime(tmp_path / "index.bin", ns=(1, 1))  # the index file was written again
    assert key != key_of(doc)


def test_key_of_a_layer_with_a_parse_key_does_not_change_when_its_index_file_appears(tmp_path: Path) -> None:
    """A layer stored as metadata bytes gets its index file from the first mount's quiet-time
    child, just before that child writes the image: the next mount must find that image."""
    _path, doc = _state(tmp_path)
    (tmp_path / "index.bin").unlink()
    layer = doc["runs"][0][0]
    layer["parse_key"] = "estargz:toc-sha256:" + "b" * 64
    before = key_of(doc)
    (tmp_path / "index.bin").write_bytes(b"the derived index")
    assert key_of(doc) == before
    layer["parse_key"] = "estargz:toc-sha256:" + "c" * 64  # the layer was resolved again: other metadata
    assert key_of(doc) != before


def test_attach_detach_prune(tmp_path: Path) -> None:
    state, doc = _state(tmp_path)
    images = MetaImages(tmp_path / "root", enabled=True)
    assert images.wait_probed(30) and images.available  # CI's kernel stacks them
    key = key_of(doc)
    target = tmp_path / "meta"
    assert not images.attach(key, target)  # not written yet
    assert build_image(state, images.image(key)) == 0
    try:
        assert images.attach(key, target) and is_mountpoint(target)
        assert os.readlink(target / "0" / "etc" / "link") == "hostname"
        assert images.attach(key, target)  # already there: nothing stacked twice
        assert sum(1 for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if f" {target} " in line) == 1
    finally:
        images.detach(target)
    assert not is_mountpoint(target)
    stale = images.dir / f"{key}.erofs.999999999.tmp"  # a writer that died half way
    stale.write_bytes(b"x")
    assert images.prune() == []  # its index file is still there
    assert not stale.exists()
    (tmp_path / "index.bin").unlink()
    assert images.prune() == [key]
    assert list(images.dir.iterdir()) == []


def test_a_damaged_image_is_dropped(tmp_path: Path) -> None:
    state, doc = _state(tmp_path)
    images = MetaImages(tmp_path / "root", enabled=True)
    key = key_of(doc)
    assert build_image(state, images.image(key)) == 0 and images.wait_probed(30)
    sources = json.loads(sources_path(images.image(key)).read_text())
    sources["boot_id"] = "an-earlier-boot"
    sources_path(images.image(key)).write_text(json.dumps(sources))
    images.image(key).write_bytes(b"\x00" * sources["bytes"])  # a crash left zeros where the bytes were
    assert not images.attach(key, tmp_path / "meta")
    assert not is_mountpoint(tmp_path / "meta") and not images.image(key).exists()


def test_a_failed_probe_or_the_setting_turns_it_off(tmp_path: Path) -> None:
    state, doc = _state(tmp_path)
    images = MetaImages(tmp_path / "root", enabled=True, probe_kernel=lambda d: "no data-only layers here")
    assert images.wait_probed(10) and not images.available
    assert build_image(state, images.image(key_of(doc))) == 0
    assert not images.attach(key_of(doc), tmp_path / "meta") and not is_mountpoint(tmp_path / "meta")
    off = MetaImages(tmp_path / "root2", enabled=False)
    assert not off.available and not off.attach(key_of(doc), tmp_path / "meta")
