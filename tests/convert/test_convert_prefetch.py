"""--prefetch-list: listed files first with the landmark after them (eStargz / zstd:chunked), or the
Nydus prefetch table; names not in the image are ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from snapshotter.config import Config
from snapshotter.formats.index import EntryType, Landmark
from snapshotter.formats.nydus import parse_bootstrap
from snapshotter.formats.nydus_layer import bootstrap_from_layer
from snapshotter.image.oci_layout import OciLayout
from snapshotter.inspect import index_of_file
from tests.convert.conftest import Source
from tests.convert.helpers import layout_image, run_cli

RECORD = "/etc/hosts\n/usr/lib/app.so\n\n# a comment\ndata/big.bin\n/not/in/the/image\n"
# per source layer, the listed names it holds, in list order
EXPECTED = [("data/big.bin",), ("etc/hosts",), ("usr/lib/app.so", "data/big.bin")]


def _convert_with_list(fmt: str, source: Source, tmp_path: Path, record_text: str) -> tuple[dict[str, Any], OciLayout]:
    """`snapshotter convert --prefetch-list` of the source image to an OCI layout: (manifest, layout)."""
    record = tmp_path / "record.txt"
    record.write_text(record_text)
    out = tmp_path / "out"
    proc = run_cli("--format", fmt, "--prefetch-list", str(record), "--chunk-size", "65536", source.oci,
                   f"oci:{out}:p")
    assert proc.returncode == 0, proc.stderr
    manifest, _ = layout_image(out, "p")
    return manifest, OciLayout(out)


def _nydus_prefetch_table(manifest: dict[str, Any], lay: OciLayout) -> tuple[str, ...]:
    boot = bootstrap_from_layer(lay.blob_path(manifest["layers"][-1]["digest"]).read_bytes(),
                                max_bootstrap_bytes=64 << 20)
    return parse_bootstrap(boot, max_bootstrap_bytes=64 << 20).prefetch


@pytest.mark.parametrize("fmt", ["estargz", "zstdchunked", "nydus"])
def test_prefetch_list(fmt: str, source: Source, tmp_path: Path) -> None:
    manifest, lay = _convert_with_list(fmt, source, tmp_path, RECORD)
    if fmt == "nydus":
        assert _nydus_prefetch_table(manifest, lay) == ("etc/hosts", "usr/lib/app.so", "data/big.bin")
        return
    for layer, want in zip(manifest["layers"], EXPECTED, strict=True):
        index = index_of_file(lay.blob_path(layer["digest"]), Config())
        assert index.landmark is Landmark.PREFETCH
        assert index.prefetch == want
        # in the blob, the listed files (and their parent directories) precede the landmark
        names = [e.name for e in index.entries]
        landmark = names.index(".prefetch.landmark")
        before = [e.name for e in index.entries[:landmark] if e.type is not EntryType.DIR]
        assert tuple(before) == want
    first = index_of_file(lay.blob_path(manifest["layers"][0]["digest"]), Config())
    assert "etc/passwd" in [e.name for e in first.entries][[e.name for e in first.entries].index(".prefetch.landmark"):]


def test_no_prefetch_list_gives_no_prefetch_landmark(source: Source, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("--format", "estargz", source.oci, f"oci:{out}:p")
    assert proc.returncode == 0, proc.stderr
    manifest, _ = layout_image(out, "p")
    for layer in manifest["layers"]:
        index = index_of_file(OciLayout(out).blob_path(layer["digest"]), Config())
        assert index.landmark is Landmark.NO_PREFETCH and index.prefetch == ()


@pytest.mark.parametrize("fmt", ["estargz", "nydus"])
def test_the_lists_start_up_files_come_first_then_the_rest_in_list_order(fmt: str, source: Source,
                                                                         tmp_path: Path) -> None:
    # A prefetch streams the region in blob order; every container start reads the user database
    # (and the loader, libc) before its program's files, wherever a recorded list put them.
    manifest, lay = _convert_with_list(fmt, source, tmp_path, "/data/gone\n/data/big.bin\n/etc/passwd\n")
    if fmt == "nydus":  # data/gone is deleted by layer 2: the table names what the image holds
        assert _nydus_prefetch_table(manifest, lay) == ("etc/passwd", "data/big.bin")
        return
    index = index_of_file(lay.blob_path(manifest["layers"][0]["digest"]), Config())
    assert index.prefetch == ("etc/passwd", "data/gone", "data/big.bin")
    names = [e.name for e in index.entries]
    before = [e.name for e in index.entries[:names.index(".prefetch.landmark")] if e.type is not EntryType.DIR]
    assert before == ["etc/passwd", "data/gone", "data/big.bin"]
