"""Small helpers shared by the convert tests: run the CLI, read an output layout, compare trees."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import zstandard

from snapshotter.image.oci_layout import OciLayout
from tests.containerd_helper import Facts
from tests.convert.conftest import CONVERTED_EXTRAS

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "snapshotter.cli", "convert", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def layout_image(layout: Path, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, config) of `tag` in an OCI layout."""
    lay = OciLayout(layout)
    desc = lay.resolve(tag)
    manifest = json.loads(lay.read_blob(desc["digest"]))
    config = json.loads(lay.read_blob(manifest["config"]["digest"]))
    return manifest, config


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def uncompressed(blob: bytes, media_type: str) -> bytes:
    if media_type.endswith("+gzip"):
        return gzip.decompress(blob)
    if media_type.endswith("+zstd"):
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    return blob


def assert_same_tree(got: dict[str, Facts], want: dict[str, Facts]) -> None:
    """`got` (a converted image, unpacked) equals `want` (the source), apart from the eStargz TOC and
    landmark files and the root directory's mtime (which nobody restores)."""
    got = {n: f for n, f in got.items() if n not in CONVERTED_EXTRAS}
    want = dict(want)
    root_got, root_want = got.pop(""), want.pop("")
    assert root_got._replace(mtime=0) == root_want._replace(mtime=0)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name
