"""fusefs/spare.py and load_tree's use of it: the spare parses the preloads it is handed while it
waits, builds the image's tree once it has every layer, and a mount uses them only when its state
names exactly those parses."""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.errors import ConfigError, FormatError
from snapshotter.formats import estargz
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.index_codec import dump_index
from snapshotter.formats.metadata_parse import ESTARGZ, MetadataParse, parse_metadata
from snapshotter.fusefs import spare as spare_module
from snapshotter.fusefs.spare import wait_for_assignment
from snapshotter.fusefs.state import load_tree, parse_state
from snapshotter.fusefs.tree import build_tree
from tests.tars import tar_of

L0, L1 = "sha256:" + "0" * 64, "sha256:" + "1" * 64


def _member(files: dict[str, bytes]) -> tuple[MetadataParse, bytes, str]:
    """An eStargz layer's TOC member for `files`, how it parses, and its layer digest."""
    out = io.BytesIO()
    write_estargz(io.BytesIO(tar_of(files)), out)
    blob = out.getvalue()
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    digest = L0 if "base" in files else L1
    return MetadataParse(ESTARGZ, digest, len(blob), 1 << 20, toc_offset=footer.toc_offset), \
        blob[offset:offset + length], digest


BASE = {"base": b"b" * 100, "etc/os": b"debian\n"}
TOP = {"etc/os": b"changed\n", "app/run": b"#!/bin/sh\n"}


class _Feed:
    """stdin for the spare: `lines` in order; the last (the assignment) only once `parses()`
    reached `before_last` (at most 10 s), as the daemon hands a mount over after its layers."""

    def __init__(self, lines: list[bytes], parses: list[str], before_last: int) -> None:
        self.lines, self.parses, self.before_last = list(lines), parses, before_last

    def readline(self) -> bytes:
        if len(self.lines) == 1:
            deadline = time.monotonic() + 10
            while len(self.parses) < self.before_last and time.monotonic() < deadline:
                time.sleep(0.005)
        return self.lines.pop(0) if self.lines else b""


def _counting(parsed: list[str]):  # type: ignore[no-untyped-def]
    def parse(p: MetadataParse, data: bytes) -> LayerIndex:
        parsed.append(p.layer_digest)
        return parse_metadata(p, data)
    return parse


def _preload_line(tmp: Path, p: MetadataParse, data: bytes, layers: tuple[str, ...]) -> bytes:
    path = tmp / f"pre-{p.layer_digest[-4:]}-{len(list(tmp.iterdir()))}"
    path.write_bytes(data)
    return json.dumps({"preload": p.to_doc(), "data": str(path), "layers": list(layers)}).encode() + b"\n"


def _state(tmp: Path, specs: list[tuple[str, str, str | None]], **extra: object) -> bytes:
    """A state file with one run of (digest, index path, parse key)."""
    doc = {"mountpoint": str(tmp), "runs": [[{"layer_digest": d, "index": i, "parse_key": k,
                                              "reader": {"kind": "file"}} for d, i, k in specs]], **extra}
    return json.dumps(doc).encode()


def test_preloads_are_parsed_and_the_image_tree_built_ahead(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    lines = [_preload_line(tmp_path / "in", p0, d0, (L0, L1)), _preload_line(tmp_path / "in", p1, d1, ()),
             json.dumps({"state": "/x/state.json", "log": None}).encode() + b"\n"]
    parsed: list[str] = []
    found = wait_for_assignment(_Feed(lines, parsed, 2), parse=_counting(parsed))  # type: ignore[arg-type]
    assert found is not None and found.state == "/x/state.json" and found.log is None
    i0, i1 = parse_metadata(p0, d0), parse_metadata(p1, d1)
    assert found.preloaded == {p0.key(d0): i0, p1.key(d1): i1}
    assert list((tmp_path / "in").iterdir()) == [], "the spare removes the data files it read"
    assert found.prebuilt is not None and found.prebuilt.keys == (p0.key(d0), p1.key(d1))
    expected = build_tree([[i0, i1]], bare_runs=(0,))
    assert sorted(path for path, _ in found.prebuilt.tree.walk()) == sorted(path for path, _ in expected.walk())

    # The mount uses the prebuilt tree only for exactly its state; the index files need not exist.
    missing = str(tmp_path / "no-such-index.bin")
    prebuilt = (found.prebuilt.keys, found.prebuilt.tree)
    state = parse_state(_state(tmp_path, [(L0, missing, p0.key(d0)), (L1, missing, p1.key(d1))], bare_runs=[0]))
    assert load_tree(state, found.preloaded, prebuilt) is found.prebuilt.tree
    # Not bare: a tree of its own, built from the preloaded indexes (still no file read).
    other = load_tree(parse_state(_state(tmp_path, [(L0, missing, p0.key(d0)), (L1, missing, p1.key(d1))])),
                      found.preloaded, prebuilt)
    assert other is not found.prebuilt.tree and other.resolve("0/app/run") is not None
    # A key the spare did not parse: that layer's file is loaded.
    (tmp_path / "top.bin").write_bytes(dump_index(i1))
    mixed = load_tree(parse_state(_state(tmp_path, [(L0, missing, p0.key(d0)), (L1, str(tmp_path / "top.bin"),
                                                                                "f" * 64)], bare_runs=[0])),
                      found.preloaded, prebuilt)
    assert mixed is not found.prebuilt.tree and mixed.resolve("0/app/run") is not None
    with pytest.raises(OSError):  # and without a preload the missing file is an error, as before
        load_tree(parse_state(_state(tmp_path, [(L0, missing, None)])), found.preloaded, prebuilt)


def test_end_of_input_bad_lines_and_failed_parses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="snapshotter.fusefs.spare")
    assert wait_for_assignment(io.BytesIO(b"")) is None
    with pytest.raises(ConfigError, match="bad assignment"):
        wait_for_assignment(io.BytesIO(b'{"log": "/x"}\n'))
    p0, d0, _ = _member(BASE)
    good = _preload_line(tmp_path, p0, d0, (L0,))
    bad_doc = b'{"preload": {"kind": "tarball"}, "data": "/nowhere"}\n'
    gone = json.dumps({"preload": p0.to_doc(), "data": str(tmp_path / "gone")}).encode() + b"\n"
    damaged = _preload_line(tmp_path, p0, b"\x1f\x8bnot a toc", (L0,))
    parsed: list[str] = []
    feed = _Feed([bad_doc, gone, damaged, good, b'{"state": "/s"}\n'], parsed, 2)
    found = wait_for_assignment(feed, parse=_counting(parsed))  # type: ignore[arg-type]
    assert found is not None and list(found.preloaded) == [p0.key(d0)]
    assert "event=preload_bad" in caplog.text and caplog.text.count("event=preload_failed") == 2


def test_the_assignment_carries_the_daemons_auth_handoff() -> None:
    auth = {"challenges": {"reg.example": {"scheme": "bearer", "params": {"realm": "https://a/t"}}}, "tokens": []}
    found = wait_for_assignment(io.BytesIO(json.dumps({"state": "/s", "log": "/l", "auth": auth}).encode() + b"\n"))
    assert found is not None and (found.state, found.log, found.auth) == ("/s", "/l", auth)
    for line in (b'{"state": "/s"}\n', b'{"state": "/s", "auth": "not an object"}\n'):
        found = wait_for_assignment(io.BytesIO(line))
        assert found is not None and found.auth == {}
    with pytest.raises(ConfigError, match="bad assignment") as refused:  # no "state"
        wait_for_assignment(io.BytesIO(b'{"auth": {"tokens": [{"token": "s3cret-t0ken"}]}, "log": "/l"}\n'))
    assert "s3cret" not in str(refused.value)


def test_preloads_queued_behind_the_assignment_are_skipped(tmp_path: Path) -> None:
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    r, w = os.pipe()
    parsed: list[str] = []

    def parse(p: MetadataParse, data: bytes) -> LayerIndex:
        parsed.append(p.layer_digest)
        if len(parsed) == 1:  # the daemon hands the mount over while the first parse runs
            os.write(w, _preload_line(tmp_path, p1, d1, ()) + b'{"state": "/s"}\n')
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(t.name == "spare-stdin" for t in threading.enumerate()):
                time.sleep(0.01)
        return parse_metadata(p, data)

    os.write(w, _preload_line(tmp_path, p0, d0, (L0, L1)))
    with open(r, "rb") as stdin:
        found = wait_for_assignment(stdin, parse=parse)
    os.close(w)
    assert parsed == [L0], "the second preload is not parsed once the mount waits"
    assert found is not None and list(found.preloaded) == [p0.key(d0)] and found.prebuilt is None
    assert list(tmp_path.iterdir()) == []


def test_preloads_expire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    first = _preload_line(tmp_path, p0, d0, (L0,))
    second = _preload_line(tmp_path, p1, d1, ())
    times = iter([0.0, 0.0, 0.0, 0.0, 0.0, spare_module.PRELOAD_TTL + 1])

    def clock() -> float:
        now[0] = next(times, now[0])
        return now[0]

    parsed: list[str] = []
    found = wait_for_assignment(_Feed([first, second, b'{"state": "/s"}\n'], parsed, 2),  # type: ignore[arg-type]
                                parse=_counting(parsed), clock=clock)
    assert found is not None and list(found.preloaded) == [p1.key(d1)]


def test_a_damaged_prebuilt_key_list_is_never_used(tmp_path: Path) -> None:
    """A tree is used only for a state naming every layer's key, in order."""
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    i0, i1 = parse_metadata(p0, d0), parse_metadata(p1, d1)
    tree = build_tree([[i0, i1]], bare_runs=(0,))
    keys = (p0.key(d0), p1.key(d1))
    (tmp_path / "a.bin").write_bytes(dump_index(i0))
    (tmp_path / "b.bin").write_bytes(dump_index(i1))
    swapped = parse_state(_state(tmp_path, [(L1, str(tmp_path / "b.bin"), keys[1]),
                                            (L0, str(tmp_path / "a.bin"), keys[0])], bare_runs=[0]))
    assert load_tree(swapped, {}, (keys, tree)) is not tree
    with pytest.raises(FormatError):
        (tmp_path / "a.bin").write_bytes(b"damaged")
        load_tree(parse_state(_state(tmp_path, [(L0, str(tmp_path / "a.bin"), None)])), {}, (keys, tree))


@pytest.fixture(autouse=True)
def _unfreeze() -> Iterator[None]:
    """The spare freezes what it parsed (gc.freeze, for its own lifetime); not this test process's."""
    yield
    gc.unfreeze()


def test_the_tree_waits_for_every_layer_the_lowest_layer_lists(tmp_path: Path) -> None:
    """Upper layers (resolved ahead) may arrive first and carry no list; the lowest layer's list
    names the image, and the tree is built once all of it is parsed. A later image's list
    replaces the earlier one."""
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    parsed: list[str] = []
    lines = [_preload_line(tmp_path, p1, d1, ()), _preload_line(tmp_path, p0, d0, (L0, L1)), b'{"state": "/s"}\n']
    found = wait_for_assignment(_Feed(lines, parsed, 2), parse=_counting(parsed))  # type: ignore[arg-type]
    assert found is not None and found.prebuilt is not None
    assert found.prebuilt.keys == (p0.key(d0), p1.key(d1))
    # The lowest layer's list names a layer that never came: no tree, the indexes still.
    parsed.clear()
    other = "sha256:" + "2" * 64
    lines = [_preload_line(tmp_path, p1, d1, ()), _preload_line(tmp_path, p0, d0, (L0, other, L1)),
             b'{"state": "/s"}\n']
    found = wait_for_assignment(_Feed(lines, parsed, 2), parse=_counting(parsed))  # type: ignore[arg-type]
    assert found is not None and found.prebuilt is None
    assert sorted(found.preloaded) == sorted([p0.key(d0), p1.key(d1)])


def _asking(line: bytes, answer_id: int) -> bytes:
    """`line` (a preload) asking for an answer, under `answer_id`."""
    doc = json.loads(line)
    doc.update(id=answer_id)
    return json.dumps(doc).encode() + b"\n"


def test_a_preload_that_asks_is_answered_once_parsed_before_its_early_prefetch(tmp_path: Path) -> None:
    """The daemon stores the bytes the spare says parse instead of parsing them
    (remote/spare_replies.py): every asking preload is answered, with the TOC digest the
    daemon's parse gives, or "not ok" when the bytes do not parse; the answer comes before the
    layer's early prefetch starts (containerd's Prepare waits for it, the prefetch does not)."""
    (tmp_path / "in").mkdir()
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    lines = [_asking(_preload_line(tmp_path / "in", p0, d0, (L0, L1)), 1),
             _preload_line(tmp_path / "in", p1, d1, ()),  # not asking: no answer
             _asking(_preload_line(tmp_path / "in", p1, b"\x1f\x8bnot a toc", ()), 2),
             _asking(_preload_line(tmp_path / "in", p1, d1, ()), 4),
             b'{"state": "/s"}\n']
    events: list[object] = []
    parsed: list[str] = []

    def start_early(index: LayerIndex, doc: object) -> None:
        events.append(("early", index.toc_digest))

    lines = [_with_early(line) for line in lines]
    found = wait_for_assignment(_Feed(lines, parsed, 4), parse=_counting(parsed),  # type: ignore[arg-type]
                                reply=events.append, start_early=start_early)
    assert found is not None
    t0, t1 = parse_metadata(p0, d0).toc_digest, parse_metadata(p1, d1).toc_digest
    assert events[0] == {"id": 1, "ok": True, "toc_digest": t0}
    assert events[1] == ("early", t0)
    assert events[2] == ("early", t1)  # not asking: nothing answered
    assert isinstance(events[3], dict) and events[3]["id"] == 2 and events[3]["ok"] is False
    assert "parse failed" in str(events[3]["why"])
    assert events[4:] == [{"id": 4, "ok": True, "toc_digest": t1}, ("early", t1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], "the spare writes no file"


def _with_early(line: bytes) -> bytes:
    doc = json.loads(line)
    doc["early"] = {}
    return json.dumps(doc).encode() + b"\n"


def test_preloads_skipped_behind_the_assignment_are_answered_not_ok(tmp_path: Path) -> None:
    p0, d0, _ = _member(BASE)
    r, w = os.pipe()
    answers: list[dict[str, object]] = []

    def parse(p: MetadataParse, data: bytes) -> LayerIndex:
        os.write(w, _asking(_preload_line(tmp_path, p0, d0, ()), 7) + b'{"state": "/s"}\n')
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(t.name == "spare-stdin" for t in threading.enumerate()):
            time.sleep(0.01)
        return parse_metadata(p, data)

    os.write(w, _preload_line(tmp_path, p0, d0, (L0,)))
    with open(r, "rb") as stdin:
        found = wait_for_assignment(stdin, parse=parse, reply=answers.append)
    os.close(w)
    assert found is not None
    assert answers == [{"id": 7, "ok": False, "why": "skipped: handed a mount"}]


def test_a_preload_with_an_early_object_starts_that_layers_early_prefetch(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """start_early gets the parsed index and the preload's "early" object of each layer that came
    with one, in order; what it returns rides on the assignment. One that raises or returns None
    is left out, and the spare goes on."""
    caplog.set_level(logging.INFO, logger="snapshotter.fusefs.spare")
    (tmp_path / "in").mkdir()
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    with_early = [json.loads(_preload_line(tmp_path / "in", p0, d0, (L0, L1))),
                  json.loads(_preload_line(tmp_path / "in", p1, d1, ()))]
    with_early[0]["early"] = {"reader": {"layer_digest": L0}}
    with_early[1]["early"] = {"reader": {"layer_digest": L1}}
    plain = _preload_line(tmp_path / "in", p1, d1, ())
    assignment = json.dumps({"state": "/x/state.json", "log": None}).encode() + b"\n"
    calls: list[tuple[int, object]] = []

    def start_early(index: LayerIndex, doc: object) -> object:
        calls.append((len(index.entries), doc))
        if len(calls) == 2:
            raise RuntimeError("no thread for you")
        return f"early-{len(calls)}"

    lines = [json.dumps(d).encode() + b"\n" for d in with_early] + [plain, assignment]
    parsed: list[str] = []
    found = wait_for_assignment(_Feed(lines, parsed, 3), parse=_counting(parsed),  # type: ignore[arg-type]
                                start_early=start_early)
    assert found is not None and found.early == ["early-1"]
    i0, i1 = parse_metadata(p0, d0), parse_metadata(p1, d1)
    assert calls == [(len(i0.entries), {"reader": {"layer_digest": L0}}),
                     (len(i1.entries), {"reader": {"layer_digest": L1}})]  # the plain preload: no call
    assert "event=early_prefetch_not_started" in caplog.text and "no thread for you" in caplog.text
    assert found.prebuilt is not None  # the tree is built ahead as before


def test_the_tree_built_ahead_waits_a_bounded_while_for_the_early_requests_to_go_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the tree holds the GIL: it starts once every early prefetch says its requests
    are out (`wait_sent`), or EARLY_SENT_WAIT after it began waiting, whichever comes first."""
    (tmp_path / "in").mkdir()
    p0, d0, _ = _member(BASE)
    p1, d1, _ = _member(TOP)
    order: list[str] = []
    timeouts: list[float] = []

    class Early:
        def __init__(self, sends: bool) -> None:
            self.sends = sends

        def wait_sent(self, timeout: float) -> bool:
            timeouts.append(timeout)
            order.append("wait_sent")
            if not self.sends:
                time.sleep(timeout)
            return self.sends

    made = iter([Early(sends=False), Early(sends=True)])
    real_build = spare_module.build_tree

    def build(*args: object, **kwargs: object) -> object:
        order.append("build_tree")
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(spare_module, "build_tree", build)
    lines = [_with_early(_preload_line(tmp_path / "in", p0, d0, (L0, L1))),
             _with_early(_preload_line(tmp_path / "in", p1, d1, ())), b'{"state": "/s"}\n']
    parsed: list[str] = []
    began = time.monotonic()
    found = wait_for_assignment(_Feed(lines, parsed, 2), parse=_counting(parsed),  # type: ignore[arg-type]
                                start_early=lambda index, doc: next(made))
    assert found is not None and found.prebuilt is not None
    assert order == ["wait_sent", "wait_sent", "build_tree"]
    # The first one never sends: it gets the whole wait; the second only what is left of it.
    assert timeouts[0] == pytest.approx(spare_module.EARLY_SENT_WAIT, abs=0.005)
    assert timeouts[1] <= 0.005
    assert time.monotonic() - began < 10
