"""Fixtures for `snapshotter convert`: a registry, a containerd, and a small multi-layer source image.

The source image (built here with integration/images.py, pushed with skopeo keeping digests):
layer 1: etc/, etc/passwd, data/big.bin (3 MiB + 5, several chunks), data/gone, opq/old, opq/keep/;
layer 2: whiteout of data/gone, opaque opq/, opq/new, etc/hosts + hard link etc/hosts2, bin/sh -> busybox;
layer 3: usr/lib/app.so, data/big.bin replaced by a shorter file.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration.images import BuiltImage, Dir, Entry, File, Hardlink, Opaque, Symlink, Whiteout, build_image
from tests.containerd_helper import Containerd, Facts, fs_tree, start_containerd
from tests.fetch.registry import RegistryProcess

BIG = random.Random(7).randbytes((3 << 20) + 5)
LAYERS: list[list[Entry]] = [
    [Dir("etc"), File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"), File("data/big.bin", BIG),
     File("data/gone", b"to be deleted\n"), File("opq/old", b"hidden by the opaque dir\n"), Dir("opq/keep")],
    [Whiteout("data/gone"), Opaque("opq"), File("opq/new", b"new\n"), File("etc/hosts", b"127.0.0.1 localhost\n"),
     Hardlink("etc/hosts2", "etc/hosts"), Symlink("bin/sh", "busybox"), File("bin/busybox", b"#!fake\n", 0o755)],
    [File("usr/lib/app.so", random.Random(8).randbytes(200_000), 0o755), File("data/big.bin", b"smaller now\n")],
]
CONVERTED_EXTRAS = {"stargz.index.json", ".prefetch.landmark", ".no.prefetch.landmark"}


@dataclass(frozen=True)
class Source:
    image: BuiltImage
    layout: Path
    registry_ref: str  # HOST:PORT/src/app:v1

    @property
    def oci(self) -> str:
        return f"oci:{self.layout}:v1"


@pytest.fixture(scope="session")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    ctd = start_containerd(tmp_path_factory.mktemp("convert-ctd"))
    try:
        yield ctd
    finally:
        ctd.stop()


def skopeo_copy(src: str, dst: str) -> None:
    proc = subprocess.run(["skopeo", "copy", "--preserve-digests", "--src-tls-verify=false",
                           "--dest-tls-verify=false", src, dst], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory, registry: RegistryProcess) -> Source:
    layout = tmp_path_factory.mktemp("convert-src") / "layout"
    image = build_image(layout, "v1", LAYERS)
    ref = f"{registry.host}/src/app:v1"
    skopeo_copy(f"oci:{layout}:v1", f"docker://{ref}")
    return Source(image, layout, ref)


@pytest.fixture(scope="session")
def source_tree(source: Source, containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Facts]:
    """The source image as containerd's ordinary pull + overlayfs unpack shows it."""
    containerd.ctr("images", "pull", "--plain-http", source.registry_ref)
    with containerd.mounted_image(source.registry_ref, tmp_path_factory.mktemp("src-mnt")) as mnt:
        tree = fs_tree(mnt)
    # the fixture image is what we think it is: whiteout and opaque dir applied, layer 3 wins
    assert "data/gone" not in tree and "opq/old" not in tree and "opq/keep" not in tree
    assert tree["opq/new"].type == "reg" and tree["data/big.bin"].size == len(b"smaller now\n")
    return tree
