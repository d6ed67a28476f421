"""The metadata scale benchmark (integration.bench.metadata_scale) on a small layer, so it cannot
rot: every format's metadata parses back to every entry of the synthetic tar, in a child process,
and the report has a row per format. No timings are asserted."""

from __future__ import annotations

import csv
import hashlib
import tarfile
from pathlib import Path

import pytest

from integration.bench import metadata_scale


def test_the_synthetic_layer_is_the_same_every_time(tmp_path: Path) -> None:
    a = metadata_scale.build_tar(130, tmp_path / "a.tar")
    b = metadata_scale.build_tar(130, tmp_path / "b.tar")
    assert a == b
    assert hashlib.sha256((tmp_path / "a.tar").read_bytes()).digest() == \
        hashlib.sha256((tmp_path / "b.tar").read_bytes()).digest()
    with tarfile.open(tmp_path / "a.tar") as tf:
        members = tf.getmembers()
    assert len(members) == a.entries
    assert sum(m.isfile() for m in members) == 130
    assert sum(m.issym() for m in members) == 130 // metadata_scale.SYMLINK_EVERY
    assert len({m.name for m in members}) == len(members)


def test_every_format_parses_back_every_entry_and_is_reported(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert metadata_scale.main(["--files", "120", "--cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    layer = metadata_scale.Layer(120, metadata_scale.build_tar(120, tmp_path / "again.tar").entries)
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["format"] for r in rows] == list(metadata_scale.FORMATS)
    for r in rows:
        # The Nydus bootstrap has the root directory as an entry of its own; the tar formats do not.
        expected = layer.entries + (1 if r["format"] == "nydus" else 0)
        assert int(r["files"]) == 120 and int(r["entries"]) == expected, r
        assert float(r["metadata_mb"]) > 0 and float(r["parse_s"]) > 0 and float(r["tree_s"]) > 0
        assert float(r["index_tree_mib"]) >= 0 and float(r["peak_mib"]) >= 0
    report = (out / "report.md").read_text()
    assert sum(line.startswith("| ") for line in report.splitlines()) == len(rows) + 1  # header, one per row


def test_a_bad_format_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        metadata_scale.main(["--files", "10", "--formats", "estargz,squashfs", "--cache", str(tmp_path)])
    assert exc.value.code == 2
    assert "unknown squashfs" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing built for a refused run


@pytest.mark.parametrize("fmt", metadata_scale.FORMATS)
def test_parsed_entries_and_nodes_share_their_equal_modes_and_a_one_chunk_files_size(
        tmp_path: Path, fmt: str) -> None:
    """What keeps the per-entry memory the benchmark reports: CPython makes a new int object for
    every decoded number above 256, 28 bytes each, and the mount keeps one per entry and node."""
    from snapshotter.formats.index import TYPE_REG
    from snapshotter.formats.index_codec import dump_index, load_index
    from snapshotter.formats.metadata_parse import parse_metadata
    from snapshotter.fusefs.tree import build_tree

    metadata_scale.build_tar(60, tmp_path / "layer.tar")
    converted = tmp_path / f"layer.{fmt}"
    metadata_scale.convert(tmp_path / "layer.tar", fmt, converted)
    parsed = parse_metadata(*metadata_scale.metadata_of(fmt, converted))
    for index in (parsed, load_index(dump_index(parsed))):  # as parsed, and as a restarted mount loads it
        files = [e for e in index.entries if e.type is TYPE_REG]
        assert len(files) == 60 and len({e.mode for e in files}) == 1 and files[0].mode > 256
        assert len({id(e.mode) for e in files}) == 1
        one_chunk = [e for e in files if len(e.chunks) == 1 and e.size > 256]
        assert one_chunk and all(e.chunks[0].size is e.size for e in one_chunk)
        tree = build_tree([[index]])
        nodes = [n for n in tree.nodes.values() if n.entry is not None and n.entry.type is TYPE_REG]
        assert len(nodes) == 60 and all(n.mode is n.entry.mode for n in nodes)
