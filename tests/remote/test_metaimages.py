"""remote/metaimages.py: keys, one builder per key, mount next to a mount, prune, turning off.

Real builder processes and real erofs mounts (root; CI runs as root)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from snapshotter.formats.index_codec import dump_index
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


def _command_of(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def test_key_follows_what_the_tree_is_made_of(tmp_path: Path) -> None:
    _path, doc = _state(tmp_path)
    key = key_of(doc)
    assert key == key_of(json.loads(json.dumps(doc)))
    assert key != key_of({**doc, "bare_runs": []})
    os.utime(tmp_path / "index.bin", ns=(1, 1))  # the index file was written again
    assert key != key_of(doc)


def test_build_once_attach_detach_prune(tmp_path: Path) -> None:
    state, doc = _state(tmp_path)
    built = threading.Event()
    seen: list[str] = []
    images = MetaImages(tmp_path / "root", enabled=True, command_of=_command_of,
                        on_built=lambda k: (seen.append(k), built.set()))
    key = key_of(doc)
    target = tmp_path / "meta"
    assert not images.attach(key, target)  # nothing built yet
    images.build(key, state)
    images.build(key, state)  # one builder per key
    assert built.wait(60), (tmp_path / "root" / "metaimages" / f"{key}.log").read_text()
    assert seen == [key] and images.image(key).exists()
    try:
        assert images.attach(key, target) and is_mountpoint(target)
        assert os.readlink(target / "0" / "etc" / "link") == "hostname"
        assert images.attach(key, target)  # already there: nothing stacked twice
        assert sum(1 for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if f" {target} " in line) == 1
    finally:
        images.detach(target)
    assert not is_mountpoint(target)
    built.clear()
    images.build(key, state)  # built before: no builder, no callback
    assert not built.wait(1.0)
    assert images.prune() == []  # its index file is still there
    (tmp_path / "index.bin").unlink()
    assert images.prune() == [key]
    assert list((tmp_path / "root" / "metaimages").glob(f"{key}*.erofs")) == []
    assert not (tmp_path / "root" / "metaimages" / f"{key}.sources.json").exists()


def test_a_kernel_that_cannot_stack_turns_it_off(tmp_path: Path) -> None:
    state, doc = _state(tmp_path)
    done = threading.Event()
    images = MetaImages(tmp_path / "root", enabled=True, on_built=lambda k: done.set(),
                        command_of=lambda module, *args: ["sh", "-c", "exit 3"])
    assert images.available
    images.build(key_of(doc), state)
    for _ in range(100):
        if not images.available:
            break
        done.wait(0.05)
    assert not images.available and not done.is_set()
    assert not images.attach(key_of(doc), tmp_path / "meta")


def test_disabled_builds_nothing(tmp_path: Path) -> None:
    state, doc = _state(tmp_path)
    images = MetaImages(tmp_path / "root", enabled=False, command_of=_command_of, on_built=lambda k: None)
    images.build(key_of(doc), state)
    assert not images.available and not (tmp_path / "root" / "metaimages").exists()


def test_a_failed_build_is_not_retried_on_every_mount(tmp_path: Path) -> None:
    """A builder that fails (a bad index, say) is logged once; the next ensure of the mount does
    not start it again (each Mounts call would), the daemon's next start does."""
    state, doc = _state(tmp_path)
    runs = tmp_path / "runs"
    images = MetaImages(tmp_path / "root", enabled=True, on_built=lambda k: None,
                        command_of=lambda module, *args: ["sh", "-c", f"echo run >> {runs}; exit 2"])
    key = key_of(doc)
    images.build(key, state)
    for _ in range(100):
        if key in images.failed:
            break
        threading.Event().wait(0.05)
    images.build(key, state)
    assert runs.read_text() == "run\n" and key in images.failed and images.available
