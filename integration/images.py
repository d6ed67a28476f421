"""Build small, real OCI images offline, written directly as an OCI image layout.

Contract:
- `build_image(layout_dir, tag, layers, cmd=...)` writes (or extends) an OCI image layout at
  `layout_dir` (`oci-layout`, `index.json`, `blobs/sha256/...`) holding one image tagged `tag`
  whose layers are gzip-compressed tars made exactly from the given entries, in order. Whiteouts
  and opaque markers are written verbatim (`.wh.NAME`, `.wh..wh..opq`), which is why we write tars
  ourselves rather than letting a tool diff directories.
- Output is deterministic: same inputs -> same digests (fixed mtimes, uid/gid 0, gzip mtime 0).
- `foundation_image(layout_dir)` builds the four-layer busybox image the Foundation tests use and
  returns a `BuiltImage` that also records what a container should observe (`FoundationExpect`).

Pushing is `skopeo copy --preserve-digests oci:DIR:TAG docker://HOST/NAME:TAG` (see lab.Lab.push),
so the digests recorded here are the ones the registry serves.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import platform
import random
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"

BUSYBOX = Path("/bin/busybox")
# Applets linked into the image; the tests' shell snippets use only these.
APPLETS = (
    "sh",
    "cat",
    "ls",
    "sha256sum",
    "echo",
    "test",
    "[",
    "stat",
    "wc",
    "head",
    "tail",
    "find",
    "readlink",
    "true",
    "false",
    "sleep",
    "grep",
    "mkdir",
    "rm",
    "touch",
    "dd",
    "du",
    "env",
    "id",
    "printf",
    "sort",
    "tr",
    "cut",
    "cmp",
    "md5sum",
    "uname",
)
FIXED_MTIME = 1_700_000_000  # any fixed time: keeps layer digests reproducible


# ---- layer entries -------------------------------------------------------------------------


@dataclass(frozen=True)
class Dir:
    path: str
    mode: int = 0o755


@dataclass(frozen=True)
class File:
    path: str
    data: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class Symlink:
    path: str
    target: str


@dataclass(frozen=True)
class Hardlink:
    path: str
    target: str  # path of an earlier entry in the same layer


@dataclass(frozen=True)
class Whiteout:
    """Deletes `path` (from lower layers) by writing `dirname/.wh.basename`."""

    path: str


@dataclass(frozen=True)
class Opaque:
    """Marks directory `path` opaque: `path/.wh..wh..opq` hides all lower contents of it."""

    path: str


Entry = Dir | File | Symlink | Hardlink | Whiteout | Opaque


def _norm(path: str) -> str:
    p = path.strip("/")
    if not p or ".." in p.split("/"):
        raise ValueError(f"bad image path: {path!r}")
    return p


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    ti.mtime = FIXED_MTIME
    return ti


def layer_tar(entries: Iterable[Entry]) -> bytes:
    """An uncompressed layer tar holding `entries` in order; parent dirs are added once, first."""
    buf = io.BytesIO()
    seen_dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def ensure_parents(p: str) -> None:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in seen_dirs:
                    seen_dirs.add(d)
                    tar.addfile(_info(d, tarfile.DIRTYPE, 0o755))

        for e in entries:
            if isinstance(e, Dir):
                p = _norm(e.path)
                ensure_parents(p)
                if p not in seen_dirs:
                    seen_dirs.add(p)
                    tar.addfile(_info(p, tarfile.DIRTYPE, e.mode))
            elif isinstance(e, File):
                p = _norm(e.path)
                ensure_parents(p)
                ti = _info(p, tarfile.REGTYPE, e.mode)
                ti.size = len(e.data)
                tar.addfile(ti, io.BytesIO(e.data))
            elif isinstance(e, Symlink):
                p = _norm(e.path)
                ensure_parents(p)
                ti = _info(p, tarfile.SYMTYPE, 0o777)
                ti.linkname = e.target
                tar.addfile(ti)
            elif isinstance(e, Hardlink):
                p = _norm(e.path)
                ensure_parents(p)
                ti = _info(p, tarfile.LNKTYPE, 0o644)
                ti.linkname = _norm(e.target)
                tar.addfile(ti)
            elif isinstance(e, Whiteout):
                p = _norm(e.path)
                head, _, base = p.rpartition("/")
                wh = f"{head}/.wh.{base}" if head else f".wh.{base}"
                ensure_parents(wh)
                tar.addfile(_info(wh, tarfile.REGTYPE, 0o644))
            elif isinstance(e, Opaque):
                p = _norm(e.path)
                ensure_parents(p + "/x")
                if p not in seen_dirs:
                    seen_dirs.add(p)
                    tar.addfile(_info(p, tarfile.DIRTYPE, 0o755))
                tar.addfile(_info(f"{p}/.wh..wh..opq", tarfile.REGTYPE, 0o644))
            else:  # pragma: no cover - exhaustive over Entry
                raise TypeError(e)
    return buf.getvalue()


# ---- OCI layout --------------------------------------------------------------------------------


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(m, m)


@dataclass(frozen=True)
class Layer:
    digest: str  # of the gzip blob, as in the manifest
    size: int
    diff_id: str  # of the uncompressed tar, as in config rootfs.diff_ids


@dataclass(frozen=True)
class BuiltImage:
    layout: Path
    tag: str
    manifest_digest: str
    config_digest: str
    layers: tuple[Layer, ...]
    expect: FoundationExpect | None = None

    @property
    def oci_ref(self) -> str:
        """skopeo source name for this image."""
        return f"oci:{self.layout}:{self.tag}"


def _write_blob(layout: Path, data: bytes) -> str:
    digest = sha256_digest(data)
    path = layout / "blobs" / "sha256" / digest.split(":", 1)[1]
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
    return digest


def build_image(
    layout_dir: Path,
    tag: str,
    layers: Sequence[Sequence[Entry] | bytes],
    *,
    cmd: Sequence[str] = ("/bin/sh",),
    env: Sequence[str] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
    labels: dict[str, str] | None = None,
) -> BuiltImage:
    """Write an image made of `layers` into the OCI layout at `layout_dir` under `tag`.

    An existing layout is extended; an existing entry with the same tag is replaced.
    """
    layout = Path(layout_dir)
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))

    built: list[Layer] = []
    for entries in layers:
        raw = entries if isinstance(entries, bytes) else layer_tar(entries)  # bytes: a ready layer tar
        gz = gzip.compress(raw, compresslevel=6, mtime=0)
        digest = _write_blob(layout, gz)
        built.append(Layer(digest=digest, size=len(gz), diff_id=sha256_digest(raw)))

    created = "2023-11-14T22:13:20Z"  # FIXED_MTIME, so the config digest is stable too
    config = {
        "created": created,
        "architecture": oci_arch(),
        "os": "linux",
        "config": {
            "Cmd": list(cmd),
            "Env": list(env),
            "WorkingDir": "/",
            "Labels": dict(labels or {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in built]},
        "history": [{"created": created, "created_by": f"integration.images layer {i + 1}"} for i in range(len(built))],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    config_digest = _write_blob(layout, config_bytes)

    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER_GZIP, "digest": layer.digest, "size": layer.size} for layer in built],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest = _write_blob(layout, manifest_bytes)

    index_path = layout / "index.json"
    index: dict[str, Any] = (
        json.loads(index_path.read_text())
        if index_path.exists()
        else {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": []}
    )
    index["manifests"] = [m for m in index["manifests"] if m.get("annotations", {}).get(REF_NAME_ANNOTATION) != tag]
    index["manifests"].append(
        {
            "mediaType": MEDIA_MANIFEST,
            "digest": manifest_digest,
            "size": len(manifest_bytes),
            "annotations": {REF_NAME_ANNOTATION: tag},
            "platform": {"architecture": oci_arch(), "os": "linux"},
        }
    )
    tmp = index_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    tmp.rename(index_path)
    return BuiltImage(
        layout=layout,
        tag=tag,
        manifest_digest=manifest_digest,
        config_digest=config_digest,
        layers=tuple(built),
    )


# ---- the Foundation image ----------------------------------------------------------------------


def busybox_entries(busybox: Path = BUSYBOX) -> list[Entry]:
    """/bin/busybox plus applet symlinks, and the directories runc mounts over."""
    entries: list[Entry] = [File("bin/busybox", busybox.read_bytes(), 0o755)]
    entries += [Symlink(f"bin/{a}", "busybox") for a in APPLETS]
    entries += [Dir(d) for d in ("dev", "proc", "sys", "tmp", "etc", "root")]
    return entries


def deterministic_bytes(size: int, seed: int = 4242) -> bytes:
    return random.Random(seed).randbytes(size)


@dataclass(frozen=True)
class FoundationExpect:
    """What a container of the Foundation image must (not) see. Paths are absolute."""

    # path -> exact content, one per layer (layer 1..3 text files)
    texts: dict[str, str] = field(default_factory=dict)
    hardlink: tuple[str, str] = ("", "")  # (link, target): same inode, same content
    symlink: tuple[str, str] = ("", "")  # (link path, link target text)
    deleted: str = ""  # present in layer 1, whited out in layer 3
    opaque_dir: str = ""  # made opaque in layer 3
    opaque_lower: tuple[str, ...] = ()  # layer-1 contents of opaque_dir: must be gone
    opaque_upper: tuple[str, ...] = ()  # what opaque_dir holds after layer 3 (names)
    big_file: str = ""  # layer 4
    big_size: int = 0
    big_sha256: str = ""


BIG_SIZE = 3 * 1024 * 1024 + 12345  # a few MB, not a multiple of any chunk size


def foundation_layers() -> tuple[list[list[Entry]], FoundationExpect]:
    big = deterministic_bytes(BIG_SIZE)
    l1: list[Entry] = busybox_entries() + [
        File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"),
        File("etc/group", b"root:x:0:\n"),
        File("etc/layer1.txt", b"from layer 1\n"),
        File("etc/doomed.txt", b"deleted in layer 3\n"),
        File("opaque/lower-a.txt", b"lower a\n"),
        File("opaque/sub/lower-b.txt", b"lower b\n"),
        File("opaque/keep-name.txt", b"lower version\n"),
    ]
    l2: list[Entry] = [
        File("data/layer2.txt", b"from layer 2\n"),
        Hardlink("data/layer2-hard.txt", "data/layer2.txt"),
        Symlink("data/layer2-sym", "layer2.txt"),
        File("etc/layer1.txt", b"from layer 1, overwritten by layer 2\n"),
    ]
    l3: list[Entry] = [
        Whiteout("etc/doomed.txt"),
        Opaque("opaque"),
        File("opaque/upper.txt", b"upper from layer 3\n"),
        File("opaque/keep-name.txt", b"upper version\n"),
        File("etc/layer3.txt", b"from layer 3\n"),
    ]
    l4: list[Entry] = [File("big/blob.bin", big)]
    expect = FoundationExpect(
        texts={
            "/etc/layer1.txt": "from layer 1, overwritten by layer 2\n",
            "/data/layer2.txt": "from layer 2\n",
            "/etc/layer3.txt": "from layer 3\n",
            "/opaque/upper.txt": "upper from layer 3\n",
            "/opaque/keep-name.txt": "upper version\n",
            "/etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
        },
        hardlink=("/data/layer2-hard.txt", "/data/layer2.txt"),
        symlink=("/data/layer2-sym", "layer2.txt"),
        deleted="/etc/doomed.txt",
        opaque_dir="/opaque",
        opaque_lower=("/opaque/lower-a.txt", "/opaque/sub"),
        opaque_upper=("keep-name.txt", "upper.txt"),
        big_file="/big/blob.bin",
        big_size=len(big),
        big_sha256=hashlib.sha256(big).hexdigest(),
    )
    return [l1, l2, l3, l4], expect


def foundation_image(layout_dir: Path, tag: str = "foundation") -> BuiltImage:
    """Build the four-layer Foundation image into `layout_dir`; rebuilding yields the same digests."""
    layers, expect = foundation_layers()
    img = build_image(layout_dir, tag, layers, cmd=("/bin/sh", "-c", "cat /etc/layer3.txt"))
    return BuiltImage(
        layout=img.layout,
        tag=img.tag,
        manifest_digest=img.manifest_digest,
        config_digest=img.config_digest,
        layers=img.layers,
        expect=expect,
    )
