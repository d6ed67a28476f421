"""Images for the fault suite, built in memory and pushed straight to the lab registry.

Every image is [busybox (plain gzip: containerd unpacks it, so `sh` never depends on the lazy
path), data layer (eStargz made by our writer, small chunks, or a hand-made hostile blob)].
The data layer's files are random bytes from a per-image seed, so no two tests share chunks
(the chunk cache is content addressed and resolved layers are kept by digest).

Pushing uses the registry's HTTP API (monolithic blob upload, manifest PUT) with urllib.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from integration import images
from snapshotter.formats.estargz_footer import footer_bytes
from snapshotter.formats.estargz_writer import write_estargz
from tests import tars

CHUNK = 64 << 10  # small eStargz chunks: many chunks per file, many ranges to count


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class LayerBlob:
    data: bytes
    diff_id: str
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return sha256(self.data)


@dataclass(frozen=True)
class Pushed:
    ref: str
    repo: str
    data_layer: str  # digest of the eStargz/hostile layer
    files: dict[str, bytes]  # path in the container -> content


def tar_of(files: dict[str, bytes], dirs: tuple[str, ...] = ("data",)) -> bytes:
    """`files` (container paths: a leading "/" is dropped) under `dirs`, at the images' fixed time."""
    return tars.tar_of({name.lstrip("/"): data for name, data in files.items()}, dirs=dirs,
                       mtime=images.FIXED_MTIME)


def busybox_layer() -> LayerBlob:
    raw = images.layer_tar(images.busybox_entries())
    return LayerBlob(gzip.compress(raw, compresslevel=6, mtime=0), sha256(raw))


def estargz_layer(files: dict[str, bytes]) -> LayerBlob:
    out = io.BytesIO()
    res = write_estargz(io.BytesIO(tar_of(files)), out, chunk_size=CHUNK, prefetch=None, level=1)
    return LayerBlob(out.getvalue(), res.diff_id, res.annotations())


def data_files(seed: int, count: int = 4, size: int = 300_000) -> dict[str, bytes]:
    """`count` files /data/fN of `size` random bytes each (distinct per seed)."""
    return {f"/data/f{i}": images.deterministic_bytes(size, seed=seed * 1000 + i) for i in range(count)}


def hostile_estargz(toc: dict[str, object], *, files: dict[str, bytes] | None = None,
                    claimed_json_size: int | None = None, trailing_zeros: int = 0) -> LayerBlob:
    """A blob with a valid eStargz shape and a hostile TOC: one gzip member holding the tar of
    `files` (benign: what containerd unpacks when we fall back), the TOC member (tar header
    "stargz.index.json" whose size field says `claimed_json_size` if given, the JSON, padding,
    `trailing_zeros` extra zero bytes - a decompression bomb - and the tar end), the footer."""
    body = tar_of(files or {"/ok.txt": b"benign\n"}, dirs=())
    body = body[: len(body) - 1024] if body.endswith(b"\0" * 1024) else body  # drop the end marker
    # tarfile pads to 10 KiB records: strip trailing zero blocks, keep whole 512-byte blocks.
    while body.endswith(b"\0" * 512):
        body = body[:-512]
    first = gzip.compress(body, mtime=0)
    toc_json = json.dumps(toc).encode()
    info = tarfile.TarInfo("stargz.index.json")
    info.size, info.mtime = len(toc_json), 0
    header = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    if claimed_json_size is not None:
        header[124:136] = b"%011o\0" % claimed_json_size
        header[148:156] = b"        "
        header[148:156] = b"%06o\0 " % sum(header)
    toc_tar = bytes(header) + toc_json + b"\0" * (-len(toc_json) % 512) + b"\0" * trailing_zeros + b"\0" * 1024
    toc_member = gzip.compress(toc_tar, compresslevel=9, mtime=0)
    blob = first + toc_member + footer_bytes(len(first))
    uncompressed = body + toc_tar
    return LayerBlob(blob, sha256(uncompressed))


def build_manifest(layers: list[LayerBlob], cmd: tuple[str, ...] = ("/bin/sh",)) -> tuple[bytes, bytes]:
    """(config bytes, manifest bytes) for `layers`."""
    config = {
        "architecture": images.oci_arch(), "os": "linux",
        "config": {"Cmd": list(cmd), "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": images.MEDIA_MANIFEST,
        "config": {"mediaType": images.MEDIA_CONFIG, "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": images.MEDIA_LAYER_GZIP, "digest": layer.digest, "size": len(layer.data),
                    **({"annotations": layer.annotations} if layer.annotations else {})} for layer in layers],
    }
    return config_bytes, json.dumps(manifest, sort_keys=True).encode()


def _request(url: str, method: str, data: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def push_blob(registry: str, repo: str, data: bytes) -> str:
    digest = sha256(data)
    status, _ = _request(f"http://{registry}/v2/{repo}/blobs/{digest}", "HEAD")
    if status == 200:
        return digest
    status, headers = _request(f"http://{registry}/v2/{repo}/blobs/uploads/", "POST", b"")
    assert status == 202, f"blob upload start: {status}"
    location = headers["Location"]
    if location.startswith("/"):
        location = f"http://{registry}{location}"
    sep = "&" if "?" in location else "?"
    status, _ = _request(f"{location}{sep}digest={digest}", "PUT", data,
                         {"Content-Type": "application/octet-stream"})
    assert status == 201, f"blob upload of {digest}: {status}"
    return digest


def push_image(registry: str, repo: str, layers: list[LayerBlob], tag: str = "v1") -> str:
    config, manifest = build_manifest(layers)
    for layer in layers:
        push_blob(registry, repo, layer.data)
    push_blob(registry, repo, config)
    status, _ = _request(f"http://{registry}/v2/{repo}/manifests/{tag}", "PUT", manifest,
                         {"Content-Type": images.MEDIA_MANIFEST})
    assert status == 201, f"manifest PUT: {status}"
    return f"{registry}/{repo}:{tag}"


def push_lazy(registry: str, repo: str, files: dict[str, bytes]) -> Pushed:
    """busybox + an eStargz layer of `files`; returns the ref and the data layer digest."""
    data = estargz_layer(files)
    ref = push_image(registry, repo, [busybox_layer(), data])
    return Pushed(ref, repo, data.digest, files)
