"""MountManager.preload (remote/mounts.py): the spare is handed layer metadata without the daemon
ever waiting on it, and what cannot be handed over leaves nothing behind. The spare's side is
tests/fusefs/test_spare.py; the whole path with containerd is in tests/integration/test_lazy.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.config import Config
from snapshotter.formats.metadata_parse import ESTARGZ, NYDUS_BLOB, MetadataParse
from snapshotter.remote.mounts import MountManager
from snapshotter.remote.spare_replies import SpareParsed, SpareReplies

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


SPARE_THAT_ANSWERS = r"""
import json, os, sys
reply_fd = int(sys.argv[1])
for line in sys.stdin:
    doc = json.loads(line)
    if "id" in doc:
        digest = "sha256:" + open(doc["data"], "rb").read().decode()
        os.write(reply_fd, json.dumps({"id": doc["id"], "ok": True, "toc_digest": digest}).encode() + b"\n")
"""


def test_a_preload_that_wants_an_answer_waits_for_the_spares(manager: MountManager) -> None:
    r, w = os.pipe()
    spare = subprocess.Popen([sys.executable, "-c", SPARE_THAT_ANSWERS, str(w)], stdin=subprocess.PIPE,
                             pass_fds=(w,))
    os.close(w)
    manager._spare, manager._spare_replies = spare, SpareReplies(r, spare.pid)
    try:
        wait = manager.preload(PARSE, b"toc-bytes", PARSE.key(b"toc-bytes"), want_answer=True)
        assert wait is not None
        assert wait(10.0) == SpareParsed("sha256:toc-bytes")  # the answer to this preload, of its bytes
        # Not asked: no wait; nothing to parse (a Nydus blob layer): not asked.
        assert manager.preload(PARSE, b"other", PARSE.key(b"other")) is None
        blob = MetadataParse(NYDUS_BLOB, LAYER, 1000, 0)
        assert manager.preload(blob, b"", blob.key(b""), want_answer=True) is None
    finally:
        assert spare.stdin is not None
        spare.stdin.close()
        spare.wait(timeout=10)


def _replies() -> tuple[SpareReplies, int]:
    r, w = os.pipe()
    return SpareReplies(r, 0), w


def test_spare_replies_match_answers_to_waits(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    replies, w = _replies()
    first, second = replies.new_id(), replies.new_id()
    assert first != second
    os.write(w, b"not json\n" + json.dumps({"id": first, "ok": True, "toc_digest": None}).encode() + b"\n")
    assert replies.wait(first, 10.0) == SpareParsed(None)  # answered before the wait began
    assert "event=spare_reply_bad" in caplog.text

    def answer_later() -> None:
        time.sleep(0.2)
        os.write(w, json.dumps({"id": second, "ok": False, "why": "parse failed: bad"}).encode() + b"\n")

    threading.Thread(target=answer_later).start()
    assert replies.wait(second, 10.0) is None  # "not ok": parse it yourself
    assert "parse failed: bad" in caplog.text
    # No answer in time: None; its answer, when it comes after all, is nobody's and is dropped.
    began = time.monotonic()
    late_id = replies.new_id()
    assert replies.wait(late_id, 0.2) is None
    assert time.monotonic() - began < 5
    os.write(w, json.dumps({"id": late_id, "ok": True, "toc_digest": None}).encode() + b"\n")
    deadline = time.monotonic() + 10
    while f"event=spare_reply_late pid=0 id={late_id}" not in caplog.text:
        assert time.monotonic() < deadline, "a late answer was not recognised as one"
        time.sleep(0.01)
    assert replies._answers == {}
    # The spare closed its end (handed a mount, or died): every wait ends at once.
    os.close(w)
    began = time.monotonic()
    assert replies.wait(replies.new_id(), 30.0) is None
    assert time.monotonic() - began < 5 and replies.closed
