"""Inputs other than the happy path: bad input errors, multi-platform indexes, progress output."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
from pathlib import Path

import pytest
import zstandard

from integration.images import Dir, File, build_image
from snapshotter.config import Config
from snapshotter.convert import ConvertError, ConvertOptions, convert, read_prefetch_list
from snapshotter.image.model import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, descriptor, encode, sha256_digest
from snapshotter.image.oci_layout import OciLayout, parse_layout_spec
from snapshotter.inspect import index_of_file
from tests.convert.conftest import Source
from tests.convert.helpers import layout_image, run_cli
from tests.fetch.registry import RegistryProcess
from tests.tars import tar_of


def write_image(layout: Path, tag: str, layer_blobs: list[tuple[bytes, bytes]], platform: str = "amd64",
                media_types: list[str] | None = None) -> dict:
    """An image whose layers are the given (blob, uncompressed content) pairs, verbatim."""
    lay = OciLayout(layout)
    config = encode({"architecture": platform, "os": "linux",
                     "rootfs": {"type": "layers", "diff_ids": [sha256_digest(raw) for _, raw in layer_blobs]}})
    lay.write_blob(config)
    layers = []
    for i, (blob, _) in enumerate(layer_blobs):
        lay.write_blob(blob)
        layers.append(descriptor(media_types[i] if media_types else OCI_LAYER_GZIP, blob))
    manifest = encode({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": descriptor(OCI_CONFIG, config),
                       "layers": layers})
    lay.write_blob(manifest)
    desc = descriptor(OCI_MANIFEST, manifest)
    lay.tag(tag, desc)
    return desc


def small_tar(name: str, data: bytes) -> bytes:
    return tar_of({name: data})


# ---- bad input ---------------------------------------------------------------------------------


def test_unknown_format(source: Source, tmp_path: Path) -> None:
    proc = run_cli("--format", "squashfs", source.oci, f"oci:{tmp_path}/out:x")
    assert proc.returncode == 2
    assert "invalid choice: 'squashfs'" in proc.stderr and "estargz" in proc.stderr
    with pytest.raises(ConvertError, match="unknown format 'squashfs'"):
        ConvertOptions("squashfs")


def test_missing_source_image(source: Source, registry: RegistryProcess, tmp_path: Path) -> None:
    proc = run_cli("--format", "estargz", f"oci:{source.layout}:nope", f"oci:{tmp_path}/out:x")
    assert proc.returncode != 0
    assert f"oci:{source.layout}:nope" in proc.stderr and "no image tagged 'nope'" in proc.stderr
    assert "tags: v1" in proc.stderr
    missing = f"{registry.host}/src/missing:v1"
    proc = run_cli("--format", "estargz", "--plain-http", missing, f"oci:{tmp_path}/out:x")
    assert proc.returncode != 0
    assert f"cannot read source image {missing}" in proc.stderr and "not found (404)" in proc.stderr
    proc = run_cli("--format", "nydus", f"oci:{tmp_path}/no-such-dir:v1", f"oci:{tmp_path}/out:x")
    assert proc.returncode != 0 and "no index.json" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_layer_that_is_not_a_tar(tmp_path: Path) -> None:
    good = small_tar("ok.txt", b"fine\n")
    junk = random.Random(3).randbytes(5000)
    write_image(tmp_path / "src", "bad", [(gzip.compress(good), good), (gzip.compress(junk), junk)])
    bad_digest = sha256_digest(gzip.compress(junk))
    for fmt in ("estargz", "zstdchunked", "nydus"):
        proc = run_cli("--format", fmt, f"oci:{tmp_path}/src:bad", f"oci:{tmp_path}/out:x")
        assert proc.returncode != 0, fmt
        assert f"oci:{tmp_path}/src:bad" in proc.stderr and f"layer 2/2 ({bad_digest})" in proc.stderr, proc.stderr
        assert "not a valid tar archive" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "index.json").exists()


def test_corrupt_gzip_and_wrong_diff_id(tmp_path: Path) -> None:
    raw = small_tar("a", b"a" * 10_000)
    gz = gzip.compress(raw)
    corrupt = gz[:20] + bytes(b ^ 0xFF for b in gz[20:40]) + gz[40:]
    write_image(tmp_path / "src", "corrupt", [(corrupt, raw)])
    with pytest.raises(ConvertError, match=rf"layer 1/1 \({sha256_digest(corrupt)}\): decompressing: .*not valid"):
        convert(f"oci:{tmp_path}/src:corrupt", f"oci:{tmp_path}/out:x", ConvertOptions("estargz", progress=False))
    write_image(tmp_path / "src", "liar", [(gz, b"something else")])
    with pytest.raises(ConvertError, match=r"layer 1/1 .*but the config's diff_id is .*inconsistent"):
        convert(f"oci:{tmp_path}/src:liar", f"oci:{tmp_path}/out:x", ConvertOptions("zstdchunked", progress=False))


def test_destination_with_digest_is_refused(source: Source, registry: RegistryProcess) -> None:
    dst = f"{registry.host}/conv/x@sha256:{'0' * 64}"
    with pytest.raises(ConvertError, match="names a digest; give a tag"):
        convert(source.oci, dst, ConvertOptions("estargz", progress=False))


# ---- other source shapes, indexes and progress ----------------------------------------------------


def test_plain_and_zstd_source_layers(tmp_path: Path) -> None:
    lower = small_tar("a.txt", b"plain tar layer\n")
    upper = small_tar("b.txt", b"zstd layer\n" * 1000)
    write_image(tmp_path / "src", "mixed", [(lower, lower), (zstandard.ZstdCompressor().compress(upper), upper)],
                media_types=["application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+zstd"])
    out = tmp_path / "out"
    convert(f"oci:{tmp_path}/src:mixed", f"oci:{out}:x", ConvertOptions("estargz", progress=False))
    manifest, config = layout_image(out, "x")
    for layer, diff_id, name in zip(manifest["layers"], config["rootfs"]["diff_ids"], ("a.txt", "b.txt"),
                                    strict=True):
        blob = OciLayout(out).blob_path(layer["digest"])
        assert sha256_digest(gzip.decompress(blob.read_bytes())) == diff_id
        assert name in index_of_file(blob, Config())


def test_docker_schema2_source(source: Source, registry: RegistryProcess, tmp_path: Path) -> None:
    ref = f"{registry.host}/src/docker:v1"
    proc = subprocess.run(["skopeo", "copy", "--format", "v2s2", "--dest-tls-verify=false", source.oci,
                           f"docker://{ref}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    convert(ref, f"oci:{out}:x", ConvertOptions("zstdchunked", progress=False, plain_http=True))
    manifest, config = layout_image(out, "x")
    assert manifest["mediaType"] == OCI_MANIFEST and manifest["config"]["mediaType"] == OCI_CONFIG
    assert [layer["mediaType"] for layer in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+zstd"] * 3
    assert len(config["rootfs"]["diff_ids"]) == 3


def test_multi_platform_index(tmp_path: Path) -> None:
    src = tmp_path / "src"
    amd = build_image(src, "amd", [[Dir("etc"), File("etc/arch", b"amd64\n")]])
    arm = build_image(src, "arm", [[File("etc/arch", b"arm64\n")], [File("bin/x", b"x")]])
    lay = OciLayout(src)
    entries = []
    for img, arch in ((amd, "amd64"), (arm, "arm64")):
        manifest = lay.read_blob(img.manifest_digest)
        entries.append({**descriptor(OCI_MANIFEST, manifest), "platform": {"architecture": arch, "os": "linux"}})
    # a BuildKit-style attestation entry: not a filesystem, dropped
    entries.append({**descriptor(OCI_MANIFEST, lay.read_blob(amd.manifest_digest)),
                    "platform": {"architecture": "unknown", "os": "unknown"},
                    "annotations": {"vnd.docker.reference.type": "attestation-manifest"}})
    index = encode({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                    "manifests": entries})
    lay.write_blob(index)
    lay.tag("multi", descriptor("application/vnd.oci.image.index.v1+json", index))
    out = tmp_path / "out"
    result = convert(f"oci:{src}:multi", f"oci:{out}:multi", ConvertOptions("estargz", progress=False))
    assert [m.platform for m in result.manifests] == ["linux/amd64", "linux/arm64"]
    out_lay = OciLayout(out)
    top = out_lay.resolve("multi")
    assert top["mediaType"] == "application/vnd.oci.image.index.v1+json" and top["digest"] == result.digest
    out_index = json.loads(out_lay.read_blob(top["digest"]))
    assert [e["platform"]["architecture"] for e in out_index["manifests"]] == ["amd64", "arm64"]
    for entry, n_layers in zip(out_index["manifests"], (1, 2), strict=True):
        manifest = json.loads(out_lay.read_blob(entry["digest"]))
        assert len(manifest["layers"]) == n_layers
        assert all("containerd.io/snapshot/stargz/toc.digest" in layer["annotations"]
                   for layer in manifest["layers"])
        config = json.loads(out_lay.read_blob(manifest["config"]["digest"]))
        assert len(config["rootfs"]["diff_ids"]) == n_layers


def test_progress_only_when_asked(source: Source, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    convert(source.oci, f"oci:{tmp_path}/a:x", ConvertOptions("estargz"))  # stderr is not a TTY here
    assert capsys.readouterr().err == ""
    convert(source.oci, f"oci:{tmp_path}/b:x", ConvertOptions("nydus", progress=True))
    err = capsys.readouterr().err
    for step in ("layer 1/3 pull", "layer 3/3 unpack", "nydus build (3 layers)", "blob 2/3 push"):
        assert step in err, err
    assert "3.0 MiB / 3.0 MiB" in err  # layer 1's 3 MiB download, completed
    manifest, _ = layout_image(tmp_path / "b", "x")
    assert len(manifest["layers"]) == 4


# ---- argument parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "path", "tag"), [
    ("oci:/a/b:v1.0", "/a/b", "v1.0"), ("oci:/a/b", "/a/b", "latest"), ("oci:rel/dir:x", "rel/dir", "x"),
    ("oci:/odd:dir/sub", "/odd:dir/sub", "latest")])
def test_layout_spec(spec: str, path: str, tag: str) -> None:
    assert parse_layout_spec(spec) == (Path(path), tag)


def test_prefetch_list_parsing(tmp_path: Path) -> None:
    f = tmp_path / "list"
    f.write_text("/a/b\n./c\n\n# note\n/a/b\n  d/e/  \n")
    assert read_prefetch_list(f) == ["a/b", "c", "d/e"]
    f.write_text("ok\n/x/../../etc/shadow\n")
    with pytest.raises(ConvertError, match="line 2: .*'..'"):
        read_prefetch_list(f)
    with pytest.raises(ConvertError, match="cannot read the prefetch list"):
        read_prefetch_list(tmp_path / "missing")
