"""Nydus output: manifest layout, diff_ids, blob ids, and the kernel's erofs mount of our bootstrap.

The bootstrap from the output's bootstrap layer is mounted with `mount -t erofs -o ro` (blob
data through uncompressed device images, as tests/formats/test_nydus.py does) and must show the
source image's merged tree as containerd unpacks it (whiteouts and the opaque dir applied).
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

from snapshotter.convert import ConvertOptions, convert
from snapshotter.formats.nydus import parse_bootstrap
from snapshotter.formats.nydus_layer import bootstrap_from_layer
from snapshotter.image.oci_layout import OciLayout
from tests.containerd_helper import Facts, fs_tree
from tests.convert.conftest import Source
from tests.convert.helpers import assert_same_tree, layout_image, sha256
from tests.formats.test_nydus import device_images, mounted

CAP = 64 << 20


def test_registry_to_layout_nydus_mounts_as_erofs(source: Source, source_tree: dict[str, Facts],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(source.registry_ref, f"oci:{out}:nydus", ConvertOptions("nydus", progress=False))
    manifest, config = layout_image(out, "nydus")
    layers = manifest["layers"]
    n = len(source.image.layers)
    assert len(layers) == n + 1
    lay = OciLayout(out)
    blobs = [lay.blob_path(d["digest"]).read_bytes() for d in layers[:n]]
    for desc, blob in zip(layers[:n], blobs, strict=True):
        assert desc["mediaType"] == "application/vnd.oci.image.layer.nydus.blob.v1"
        assert desc["annotations"] == {"containerd.io/snapshot/nydus-blob": "true"}
        assert sha256(blob) == desc["digest"] and len(blob) == desc["size"]
    boot_desc = layers[n]
    assert boot_desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    ann = boot_desc["annotations"]
    assert ann["containerd.io/snapshot/nydus-bootstrap"] == "true"
    assert ann["containerd.io/snapshot/nydus-fs-version"] == "6"
    boot_layer = lay.blob_path(boot_desc["digest"]).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(boot_layer))) as tf:
        assert tf.getnames() == ["image", "image/image.boot"]
    boot = bootstrap_from_layer(boot_layer, max_bootstrap_bytes=CAP)
    # blob ids in the bootstrap = the blob layers' digests; diff_ids = uncompressed content digests
    index = parse_bootstrap(boot, max_bootstrap_bytes=CAP)
    assert ["sha256:" + b for b in index.blobs] == [d["digest"] for d in layers[:n]]
    assert json.loads(ann["containerd.io/snapshot/nydus-blob-ids"]) == list(index.blobs)
    assert config["rootfs"]["diff_ids"] == [d["digest"] for d in layers[:n]] + [sha256(gzip.decompress(boot_layer))]
    assert len(config["history"]) == n + 1
    # the kernel
    boot_path = tmp_path / "image.boot"
    boot_path.write_bytes(boot)
    devs = device_images(boot, blobs, tmp_path)
    with mounted(boot_path, tmp_path / "mnt", devs) as mnt:
        tree = fs_tree(mnt)
    assert_same_tree(tree, source_tree)
