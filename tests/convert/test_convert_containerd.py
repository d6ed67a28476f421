"""eStargz and zstd:chunked conversions, checked by containerd's ordinary pull + overlayfs unpack.

- OCI layout -> eStargz OCI layout: media types, annotations and diff_ids are consistent with the
  blobs; the layout (copied to the registry by skopeo) is pulled and unpacked by containerd into
  the source's tree.
- registry -> registry through the CLI (--plain-http): same tree; each layer's TOC digest
  annotation equals `ctr-remote image get-toc-digest` for that layer.
- zstd:chunked registry -> registry (loopback HTTPS->HTTP fallback, no flag): same tree.
"""

from __future__ import annotations

from pathlib import Path

from snapshotter.config import Config
from snapshotter.convert import ConvertOptions, convert
from snapshotter.formats.estargz import TOC_DIGEST_ANNOTATION, UNCOMPRESSED_SIZE_ANNOTATION
from snapshotter.image.oci_layout import OciLayout
from snapshotter.inspect import index_of_file
from tests.containerd_helper import Containerd, Facts, fs_tree
from tests.convert.conftest import Source, skopeo_copy
from tests.convert.helpers import assert_same_tree, layout_image, run_cli, sha256, uncompressed
from tests.fetch.registry import RegistryProcess

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def pulled_tree(ctd: Containerd, ref: str, mnt: Path) -> tuple[dict[str, Facts], dict[str, object]]:
    ctd.ctr("images", "pull", "--plain-http", ref)
    with ctd.mounted_image(ref, mnt) as m:
        return fs_tree(m), ctd.manifest(ref)


def test_layout_to_layout_estargz(source: Source, registry: RegistryProcess, containerd: Containerd,
                                  source_tree: dict[str, Facts], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = convert(source.oci, f"oci:{out}:esgz", ConvertOptions("estargz", chunk_size=1 << 20, progress=False))
    manifest, config = layout_image(out, "esgz")
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert result.digest == OciLayout(out).resolve("esgz")["digest"]
    assert len(manifest["layers"]) == len(source.image.layers) == len(config["rootfs"]["diff_ids"])
    for layer, diff_id, src in zip(manifest["layers"], config["rootfs"]["diff_ids"], source.image.layers,
                                   strict=True):
        assert layer["mediaType"] == GZIP
        blob = OciLayout(out).blob_path(layer["digest"])
        data = blob.read_bytes()
        assert sha256(data) == layer["digest"] and len(data) == layer["size"]
        tar = uncompressed(data, GZIP)
        assert sha256(tar) == diff_id != src.diff_id  # the TOC is inside the tar
        assert layer["annotations"][UNCOMPRESSED_SIZE_ANNOTATION] == str(len(tar))
        index = index_of_file(blob, Config())
        assert index.format == "estargz" and index.toc_digest == layer["annotations"][TOC_DIGEST_ANNOTATION]
    big = index_of_file(OciLayout(out).blob_path(manifest["layers"][0]["digest"]), Config())["data/big.bin"]
    assert len(big.chunks) == 4  # 3 MiB + 5 bytes in 1 MiB chunks
    # containerd's ordinary pull + overlayfs unpack of it
    ref = f"{registry.host}/conv/esgz-layout:v1"
    skopeo_copy(f"oci:{out}:esgz", f"docker://{ref}")
    tree, pulled = pulled_tree(containerd, ref, tmp_path / "mnt")
    assert pulled["layers"] == manifest["layers"]
    assert_same_tree(tree, source_tree)


def test_registry_to_registry_estargz_cli(source: Source, registry: RegistryProcess, containerd: Containerd,
                                          source_tree: dict[str, Facts], tmp_path: Path) -> None:
    dst = f"{registry.host}/conv/esgz:v1"
    proc = run_cli("--format", "estargz", "--plain-http", source.registry_ref, dst)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == dst
    assert proc.stderr == ""  # not a terminal: quiet
    tree, manifest = pulled_tree(containerd, dst, tmp_path / "mnt")
    assert proc.stdout.split()[1] == containerd.ctr("images", "ls").split(dst)[1].split()[1]
    assert_same_tree(tree, source_tree)
    layers = manifest["layers"]
    assert isinstance(layers, list) and len(layers) == 3
    for layer in layers:
        assert layer["mediaType"] == GZIP
        got = containerd.ctr("images", "get-toc-digest", layer["digest"], tool="ctr-remote").strip()
        assert got == layer["annotations"][TOC_DIGEST_ANNOTATION]


def test_registry_to_registry_zstdchunked(source: Source, registry: RegistryProcess, containerd: Containerd,
                                          source_tree: dict[str, Facts], tmp_path: Path) -> None:
    dst = f"{registry.host}/conv/zstd:v1"
    convert(source.registry_ref, dst, ConvertOptions("zstdchunked", progress=False))
    tree, manifest = pulled_tree(containerd, dst, tmp_path / "mnt")
    assert_same_tree(tree, source_tree)
    layers = manifest["layers"]
    assert isinstance(layers, list) and len(layers) == 3
    for layer in layers:
        assert layer["mediaType"] == ZSTD
        ann = layer["annotations"]
        assert ann["io.containers.zstd-chunked.manifest-position"].endswith(":1")
        assert ann["io.containers.zstd-chunked.manifest-checksum"].startswith("sha256:")
        blob = containerd.blob(layer["digest"])
        index = index_of_file(blob, Config())
        assert index.format.startswith("zstd") and index.toc_digest == ann[TOC_DIGEST_ANNOTATION]
        assert ctr_toc(containerd, layer["digest"]) == ann[TOC_DIGEST_ANNOTATION]


def ctr_toc(ctd: Containerd, digest: str) -> str:
    return ctd.ctr("images", "get-toc-digest", "--zstdchunked", digest, tool="ctr-remote").strip()
