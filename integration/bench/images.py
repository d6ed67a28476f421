"""Benchmark images, built locally and cached by recipe.

Contract:
- `ImageCache(root).layout(image)` returns an OCI layout dir holding image `image` ("small",
  "big" or "tiny") tagged `gzip` (plain gzip layers, as `docker build` would push them).
  `ImageCache.variant(image, fmt, ...)` adds the converted variants, tagged by format name:
    estargz-ours      `snapshotter convert --format estargz` (OCI layout to OCI layout)
    nydus             `snapshotter convert --format nydus`
    estargz-ctr       ctr-remote's eStargz (needs a lab: ctr-remote converts inside containerd;
                      the result is copied back into the cache with skopeo, digests preserved)
- The cache dir is `ROOT/<image>-<key>/oci`; `key` is a hash of the recipe (Debian suite, package
  list, extra layer spec and BUILD_VERSION), so changing the recipe builds a new image and an
  unchanged recipe is never rebuilt. A `done-<tag>` marker is written only after a variant is
  complete; a half-built variant (Ctrl-C) is rebuilt next time, and so is one of ours whose marker
  names an older converter (`OURS_DONE`).
- small: `debootstrap --variant=minbase --include=PACKAGES bookworm` from the machine's Debian
  mirror, one layer (apt lists, caches, /dev, /proc, /sys contents dropped).
  big: small + a second layer: /bench/big.bin (256 MiB, incompressible) and /bench/files/f000..f199
  (64 KiB each, incompressible).
  tiny: the lab's four-layer busybox Foundation image (for the smoke test; no debootstrap).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from integration import images

DEFAULT_CACHE = Path("/var/tmp/snapshotter-bench")
BUILD_VERSION = "1"
SUITE = "bookworm"
# python3 plus a modest package tree (perl, coreutils extras, sqlite, tzdata): ~100 MB on top of minbase.
PACKAGES = ("python3", "python3-yaml", "libsqlite3-0", "sqlite3", "perl", "tzdata", "ca-certificates", "curl")
BIG_FILE = "/bench/big.bin"
BIG_SIZE = 256 * 1024 * 1024
SMALL_FILES = 200
SMALL_FILE_SIZE = 64 * 1024
IMAGES = ("tiny", "small", "big")
OURS_FORMATS = {"estargz-ours": "estargz", "zstdchunked-ours": "zstdchunked", "nydus": "nydus"}


class BuildError(RuntimeError):
    """An image could not be built or converted."""


# The done marker of a variant our converter made; a marker from an older converter (whose
# output lacked something the bench measures: 2 = the tail-size hint annotation; 3 = a prefetch
# list's start-up files first, and a Nydus blob's prefetch files in list order) converts again.
OURS_DONE = "ok converter 3\n"


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 `URIs:` or one-line `deb URL`)."""
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            parts = line.split()
            if line.startswith("URIs:") and len(parts) > 1 and "security" not in parts[1]:
                return parts[1]
            if line.startswith("deb ") and "security" not in line:
                urls = [p for p in parts[1:] if "://" in p]
                if urls:
                    return urls[0]
    return "http://deb.debian.org/debian"


def recipe(image: str) -> dict[str, object]:
    r: dict[str, object] = {"image": image, "version": BUILD_VERSION}
    if image in ("small", "big"):
        r.update(suite=SUITE, variant="minbase", packages=list(PACKAGES))
    if image == "big":
        r.update(big=[BIG_FILE, BIG_SIZE], files=[SMALL_FILES, SMALL_FILE_SIZE])
    return r


def recipe_key(image: str) -> str:
    return hashlib.sha256(json.dumps(recipe(image), sort_keys=True).encode()).hexdigest()[:12]


def _dir_tar(root: Path) -> bytes:
    """An uncompressed layer tar of `root` (sorted, uid/gid kept, runtime dirs emptied)."""
    skip_contents = {"dev", "proc", "sys", "run", "tmp", "var/lib/apt/lists", "var/cache/apt", "var/cache/debconf"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            rel_dir = "" if rel_dir == "." else rel_dir
            if rel_dir in skip_contents:
                dirnames[:] = []
                continue
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                rel = f"{rel_dir}/{name}" if rel_dir else name
                full = os.path.join(dirpath, name)
                info = tar.gettarinfo(full, arcname=rel)
                if info is None:  # a socket: not representable in a layer
                    continue
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _debootstrap(dest: Path, log: Callable[[str], None]) -> None:
    mirror = debian_mirror()
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(dest), mirror]
    log(f"$ {' '.join(argv)}")
    env = dict(os.environ, PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin", DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise BuildError(f"debootstrap failed ({r.returncode}): {r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    for sub in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for p in (dest / sub).glob("*"):
            if p.is_file():
                p.unlink()


def _extra_layer() -> list[images.Entry]:
    entries: list[images.Entry] = [images.File(BIG_FILE.lstrip("/"), os.urandom(BIG_SIZE))]
    entries += [images.File(f"bench/files/f{i:03d}", os.urandom(SMALL_FILE_SIZE)) for i in range(SMALL_FILES)]
    return entries


def _blob(oci: Path, digest: str) -> Path:
    return oci / "blobs" / "sha256" / digest.split(":", 1)[1]


@dataclass
class ImageCache:
    root: Path = DEFAULT_CACHE
    log: Callable[[str], None] = print

    def dir(self, image: str) -> Path:
        return self.root / f"{image}-{recipe_key(image)}"

    def layout(self, image: str) -> Path:
        """The OCI layout of `image` holding at least the `gzip` tag (built if missing)."""
        if image not in IMAGES:
            raise BuildError(f"unknown image {image!r} (known: {', '.join(IMAGES)})")
        d = self.dir(image)
        oci = d / "oci"
        if (d / "done-gzip").exists():
            return oci
        d.mkdir(parents=True, exist_ok=True)
        self.log(f"building image {image} into {oci}")
        if image == "tiny":
            layers, _ = images.foundation_layers()
            images.build_image(oci, "gzip", layers, cmd=("/bin/sh",))
        else:
            base_tar = self._base_tar()
            layers: list[object] = [base_tar]  # type: ignore[no-redef]
            if image == "big":
                layers.append(_extra_layer())
            images.build_image(oci, "gzip", layers, cmd=("/bin/bash",))  # type: ignore[arg-type]
        (d / "done-gzip").write_text("ok\n")
        return oci

    def _base_tar(self) -> bytes:
        """The Debian rootfs tar, itself cached (shared by small and big)."""
        key = hashlib.sha256(json.dumps(recipe("small"), sort_keys=True).encode()).hexdigest()[:12]
        cached = self.root / f"rootfs-{key}.tar"
        if cached.exists():
            return cached.read_bytes()
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="debootstrap-", dir=self.root) as tmp:
            rootfs = Path(tmp) / "rootfs"
            _debootstrap(rootfs, self.log)
            data = _dir_tar(rootfs)
        part = cached.with_suffix(".part")
        part.write_bytes(data)
        part.rename(cached)
        return data

    def has(self, image: str, tag: str, marker: str | None = None) -> bool:
        """Whether variant `tag` is complete; with `marker`, only if its done file holds that text."""
        done = self.dir(image) / f"done-{tag}"
        return done.exists() and (marker is None or done.read_text() == marker)

    def convert_ours(self, image: str, fmt: str, prefetch_list: Path | None = None) -> str:
        """Convert the gzip image with `snapshotter convert`; returns the tag (`fmt`, or with a
        prefetch list "estargz-ours-landmark" / "nydus-prefetch": the list becomes the eStargz
        landmark or the Nydus bootstrap's prefetch table)."""
        if prefetch_list is None:
            tag = fmt
        else:
            tag = f"{fmt}-prefetch" if fmt == "nydus" else f"{fmt}-landmark"
        oci = self.layout(image)
        if self.has(image, tag, OURS_DONE):
            return tag
        snapshotter = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "snapshotter"
        argv = [str(snapshotter), "convert", "--format", OURS_FORMATS.get(fmt, fmt)]
        if prefetch_list is not None:
            argv += ["--prefetch-list", str(prefetch_list)]
        argv += [f"oci:{oci}:gzip", f"oci:{oci}:{tag}"]
        self.log(f"$ {' '.join(argv)}")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise BuildError(f"convert {image} to {fmt} failed: {r.stderr[-3000:]}")
        (self.dir(image) / f"done-{tag}").write_text(OURS_DONE)
        return tag

    def store_from_registry(self, image: str, tag: str, ref: str, run: Callable[[list[str]], object]) -> None:
        """Copy `ref` (pushed by a tool that converts inside a registry/containerd) into the cache."""
        oci = self.layout(image)
        run(["skopeo", "copy", "--quiet", "--preserve-digests", "--src-tls-verify=false", f"docker://{ref}",
             f"oci:{oci}:{tag}"])
        (self.dir(image) / f"done-{tag}").write_text("ok\n")

    def file_sha256(self, image: str, path: str) -> str:
        """sha256 of `path` as stored in the gzip image's layers (the last layer holding it),
        cached in `meta.json` next to the layout."""
        meta_path = self.dir(image) / "meta.json"
        meta: dict[str, str] = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if path in meta:
            return meta[path]
        oci = self.layout(image)
        index = json.loads((oci / "index.json").read_text())
        desc = next(m for m in index["manifests"] if m.get("annotations", {}).get(images.REF_NAME_ANNOTATION) == "gzip")
        manifest = json.loads(_blob(oci, desc["digest"]).read_bytes())
        found = ""
        for layer in manifest["layers"]:
            with tarfile.open(_blob(oci, layer["digest"]), mode="r:gz") as tar:
                for member in tar:
                    if member.isreg() and member.name.lstrip("./") == path.lstrip("/"):
                        f = tar.extractfile(member)
                        assert f is not None
                        h = hashlib.sha256()
                        while block := f.read(1 << 20):
                            h.update(block)
                        found = h.hexdigest()
        if not found:
            raise BuildError(f"{path} is not in image {image}")
        meta[path] = found
        meta_path.write_text(json.dumps(meta))
        return found

    def clear(self, image: str) -> None:
        shutil.rmtree(self.dir(image), ignore_errors=True)
