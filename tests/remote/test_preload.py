"""MountManager.preload (remote/mounts.py): the spare is handed layer metadata without the daemon
ever waiting on it, and what cannot be handed over leaves nothing behind. The spare's side is
tests/fusefs/test_spare.py; the whole path with containerd is in tests/integration/test_lazy.py."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.config import Config
from snapshotter.formats.metadata_parse import ESTARGZ, MetadataParse
from snapshotter.remote.mounts import MountManager

LAYER = "sha256:" + "ab" * 32
PARSE = MetadataParse(ESTARGZ, LAYER, 1000, 1 << 20, toc_offset=10)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[MountManager]:
    m = MountManager(Config(root=tmp_path, spare_mount_process=False))
    yield m
    m.close()


def _fake_spare(command: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def test_a_reading_spare_gets_the_data_file_and_a_line(manager: MountManager, tmp_path: Path) -> None:
    out = tmp_path / "lines"
    spare = _fake_spare(f"cat > {out}")
    manager._spare = spare
    manager.preload(PARSE, b"toc bytes", PARSE.key(b"toc bytes"), (LAYER,))
    assert spare.stdin is not None
    spare.stdin.close()
    spare.wait(timeout=10)
    doc = json.loads(out.read_text())
    assert MetadataParse.from_doc(doc["preload"]) == PARSE and doc["layers"] == [LAYER]
    assert Path(doc["data"]).read_bytes() == b"toc bytes"
    assert Path(doc["data"]).name == PARSE.key(b"toc bytes")


def test_a_spare_that_does_not_read_never_blocks_the_daemon(manager: MountManager) -> None:
    spare = _fake_spare("sleep 60")  # never reads its stdin: the pipe fills
    manager._spare = spare
    try:
        began = time.monotonic()
        for i in range(400):  # far more lines than a pipe holds
            manager.preload(PARSE, f"toc {i}".encode(), PARSE.key(f"toc {i}".encode()), (LAYER,))
        assert time.monotonic() - began < 30, "preload waited on the spare"
        kept = list(manager.preload_dir.iterdir())
        assert 0 < len(kept) < 400, "lines that did not fit leave no data file behind"
    finally:
        spare.kill()
        spare.wait(timeout=10)


def test_no_spare_or_preload_off_hands_nothing(tmp_path: Path) -> None:
    m = MountManager(Config(root=tmp_path, spare_mount_process=False))
    m.preload(PARSE, b"x", PARSE.key(b"x"))
    assert not m.preload_dir.exists() or not list(m.preload_dir.iterdir())
    spare = _fake_spare("cat > /dev/null")
    off = MountManager(Config(root=tmp_path / "off", spare_mount_process=False, preload_metadata=False))
    off._spare = spare
    off.preload(PARSE, b"x", PARSE.key(b"x"))
    assert not off.preload_dir.exists()
    spare.kill()
    spare.wait(timeout=10)
    m.close()
    off.close()


def test_a_new_daemon_clears_preloads_nobody_read(tmp_path: Path) -> None:
    stale = tmp_path / "mounts" / "preload"
    stale.mkdir(parents=True)
    (stale / ("0" * 64)).write_bytes(b"old")
    MountManager(Config(root=tmp_path, spare_mount_process=False)).close()
    assert not stale.exists()
