"""`snapshotter convert`: turn an image into eStargz, zstd:chunked or Nydus, layer by layer.

SRC and DST are registry references (`127.0.0.1:5000/repo:tag`) or OCI layouts (`oci:DIR[:TAG]`).

What happens, per image manifest (an index's manifests are converted one by one; attestation
entries, which hold no filesystem, are dropped with a warning; a nested index is an error):
1. Each layer blob is streamed to a temp file (digest checked), decompressed (gzip, zstd or
   plain, sniffed from the bytes) into a temp tar in 1 MiB pieces, and the tar's sha256 must
   equal the config's `rootfs.diff_ids[i]`, so a corrupt or inconsistent source stops here.
   Nothing holds a whole layer in memory.
2. eStargz (`write_estargz`): media type `application/vnd.oci.image.layer.v1.tar+gzip`,
   annotations `containerd.io/snapshot/stargz/toc.digest` and
   `io.containers.estargz.uncompressed-size`; the new diff_id is the gunzipped blob's sha256
   (the TOC is a tar entry, so it differs from the source's).
   zstd:chunked (`write_zstdchunked`, stargz-snapshotter layout): media type
   `...tar+zstd`, the annotations the writer returns (manifest position / checksum and the
   stargz TOC digest).
   Prefetch, as ctr-remote does: every layer gets a landmark. With `--prefetch-list`, the listed
   files present in a layer come first, then `.prefetch.landmark`; a layer holding none of them
   (or any layer without a list) gets `.no.prefetch.landmark` first. Unlike ctr-remote, the
   list's start-up files (fusefs/startup_files.py `startup_files_first`: the user database, the
   loader, its cache, the C library) come first in it, then the rest in list order: a prefetch
   streams the region in blob order, and every container start reads those before its program.
   Other annotations of the source descriptor are kept, except stale ones
   (`containerd.io/snapshot/*`, `containerd.io/uncompressed`, `io.containers.*`,
   `io.github.containers.*`).
3. Nydus (`write_nydus` over all layer tars at once, zstd chunks, whiteouts applied, chunks
   deduplicated across layers). Layout of the output manifest (nydusify's):
     layers[0..n-1]: one data blob per source layer, media type
       `application/vnd.oci.image.layer.nydus.blob.v1`, annotation
       `containerd.io/snapshot/nydus-blob: "true"`; digest = sha256 of the blob file = its
       RAFS blob id (a layer whose files all deduplicate away still gets its small blob, since
       the bootstrap's blob table names it);
     layers[n]: the bootstrap, a gzip'd tar holding `image/` and `image/image.boot`, media type
       `...tar+gzip`, annotations `containerd.io/snapshot/nydus-bootstrap: "true"`,
       `containerd.io/snapshot/nydus-fs-version: "6"`, and `containerd.io/snapshot/nydus-blob-ids`
       (JSON list of the blob ids, as older nydusify wrote).
   Config diff_ids = sha256 of each layer's uncompressed content, as nydusify computes them:
   a blob layer is not compressed, so its diff_id is its digest; the bootstrap's is the sha256
   of the bootstrap tar. A history entry is appended for the bootstrap layer. `--prefetch-list`
   names fill the bootstrap's prefetch table (names absent from the image are ignored), and
   their chunks come first in each blob, as nydus-image lays blobs out (one run to prefetch), in
   the list's order with its start-up files first, as for eStargz.
   Note: containerd's ordinary unpack cannot apply the blob layers (not tar streams); a Nydus
   image needs a Nydus-aware snapshotter, as with nydusify's output.
4. The new config and manifest are always OCI (`...manifest.v1+json`, `...config.v1+json`;
   Docker configs are the same JSON); the manifest keeps its annotations. Blobs go to DST as
   they are produced (registry: HEAD skips existing ones), then config, manifest, index; the
   root manifest/index is tagged with DST's tag.

Errors are `ConvertError` naming the image, the layer (position and digest) and what to do.
Progress: when enabled (default: stderr is a terminal) each step prints "done/total" bytes.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import logging
import os
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol, cast

import trio
import zstandard

from snapshotter.errors import FetchError, FormatError, SnapshotterError
from snapshotter.fetch.client import Descriptor, RegistryClient
from snapshotter.fetch.config import FetchConfig
from snapshotter.fetch.reference import Reference, parse_reference
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.index import normalize_name
from snapshotter.formats.nydus import write_nydus
from snapshotter.formats.zstdchunked import write_zstdchunked
from snapshotter.fusefs.startup_files import startup_files_first
from snapshotter.image.model import (
    DOCKER_CONFIG,
    INDEX_TYPES,
    MANIFEST_TYPES,
    NYDUS_BLOB,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    OCI_MANIFEST,
    TAR_LAYER_TYPES,
    ImageError,
    check_descriptor,
    decode,
    descriptor,
    encode,
    is_attestation,
    media_type_of,
    platform_text,
    sha256_digest,
)
from snapshotter.image.oci_layout import OciLayout, is_layout_spec, parse_layout_spec
from snapshotter.image.registry_io import RegistryPusher, pull_blob, read_json_blob

log = logging.getLogger("snapshotter.convert")

FORMATS = ("estargz", "zstdchunked", "nydus")
DEFAULT_CHUNK_SIZE = {"estargz": 4 << 20, "zstdchunked": 4 << 20, "nydus": 1 << 20}
NYDUS_BLOB_ANNOTATION = "containerd.io/snapshot/nydus-blob"
NYDUS_BOOTSTRAP_ANNOTATION = "containerd.io/snapshot/nydus-bootstrap"
NYDUS_FS_VERSION_ANNOTATION = "containerd.io/snapshot/nydus-fs-version"
NYDUS_BLOB_IDS_ANNOTATION = "containerd.io/snapshot/nydus-blob-ids"
BOOTSTRAP_NAME = "image/image.boot"
_STALE_ANNOTATION_PREFIXES = ("containerd.io/snapshot/", "containerd.io/uncompressed", "io.containers.",
                              "io.github.containers.")
_PIECE = 1 << 20
_PUSH_HINT = "; check that DST is reachable and writable (--plain-http for an HTTP registry, push credentials)"


class ConvertError(SnapshotterError):
    """The conversion failed; the message names the image, the layer and what to do."""


@dataclass(frozen=True)
class ConvertOptions:
    """format: one of FORMATS. chunk_size: None = the format's default (nydus: a power of two
    in [4 KiB, 16 MiB]). prefetch: normalized paths (`read_prefetch_list`) or None.
    progress: None = when stderr is a terminal. workdir: where temp files go (None = $TMPDIR)."""

    format: str
    chunk_size: int | None = None
    prefetch: Sequence[str] | None = None
    plain_http: bool = False
    progress: bool | None = None
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConvertError(f"unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        cs = self.chunk_size
        if cs is not None:
            if cs <= 0:
                raise ConvertError(f"--chunk-size must be positive, not {cs}")
            if self.format == "nydus" and (cs < 4096 or cs > 16 << 20 or cs & (cs - 1)):
                raise ConvertError(f"--chunk-size {cs}: Nydus needs a power of two in [4096, 16777216]")


@dataclass(frozen=True)
class ConvertedLayer:
    source_digest: str | None  # None for the Nydus bootstrap layer
    digest: str
    size: int
    media_type: str
    diff_id: str
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ConvertedManifest:
    platform: str
    digest: str
    size: int
    config_digest: str
    layers: tuple[ConvertedLayer, ...]


@dataclass(frozen=True)
class ConvertResult:
    """The root object written to DST (a manifest, or an index of the converted manifests)."""

    digest: str
    media_type: str
    size: int
    manifests: tuple[ConvertedManifest, ...]


def read_prefetch_list(path: Path) -> list[str]:
    """Paths, one per line (leading '/' optional; blank lines and '#' comments skipped), normalized
    and deduplicated in order."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConvertError(f"cannot read the prefetch list {path}: {e}") from None
    out: list[str] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        raw = line.strip()
        if not raw or raw.startswith("#"):
            continue
        try:
            name = normalize_name(raw.lstrip("/"), allow_root=False)
        except FormatError as e:
            raise ConvertError(f"prefetch list {path} line {lineno}: {e}") from None
        if name not in seen:
            seen.add(name)
            out.append(name)
    return out


def convert(src: str, dst: str, options: ConvertOptions, fetch_config: FetchConfig | None = None) -> ConvertResult:
    """Convert image `src` into `dst` (see the module docstring). Raises ConvertError."""
    return trio.run(convert_async, src, dst, options, fetch_config)


async def convert_async(src: str, dst: str, options: ConvertOptions,
                        fetch_config: FetchConfig | None = None) -> ConvertResult:
    progress = _Progress(sys.stderr.isatty() if options.progress is None else options.progress)
    needs_client = not (is_layout_spec(src) and is_layout_spec(dst))
    async with contextlib.AsyncExitStack() as stack:
        client: RegistryClient | None = None
        if needs_client:
            client = await stack.enter_async_context(RegistryClient(fetch_config or FetchConfig()))
        source = _endpoint(src, client, options, "SRC")
        sink = _endpoint(dst, client, options, "DST")
        if isinstance(sink, _RegistryEnd) and sink.ref.digest:
            raise ConvertError(f"DST {dst!r} names a digest; give a tag (the new image has a new digest)")
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="snapshotter-convert-",
                                                                     dir=options.workdir)))
        conv = _Converter(source, sink, options, work, progress)
        return await conv.run()
    raise AssertionError("unreachable")  # pragma: no cover


# ---- endpoints ------------------------------------------------------------------------------


class _Source(Protocol):
    name: str

    async def root(self) -> tuple[dict[str, Any], bytes]: ...

    async def read_json(self, desc: dict[str, Any]) -> bytes: ...

    async def fetch_blob(self, desc: dict[str, Any], out: IO[bytes], progress: Callable[[int], None]) -> None: ...


class _Sink(Protocol):
    name: str

    async def preflight(self) -> None: ...

    async def put_blob(self, path: Path, digest: str, size: int, progress: Callable[[int], None]) -> None: ...

    async def put_bytes(self, data: bytes) -> None: ...

    async def put_manifest(self, data: bytes, media_type: str, *, tag: bool) -> None: ...


class _LayoutEnd:
    def __init__(self, spec: str) -> None:
        root, self.tag = parse_layout_spec(spec)
        self.layout = OciLayout(root)
        self.name = spec

    async def root(self) -> tuple[dict[str, Any], bytes]:
        desc = self.layout.resolve(self.tag)
        return desc, self.layout.read_blob(desc["digest"])

    async def read_json(self, desc: dict[str, Any]) -> bytes:
        return self.layout.read_blob(desc["digest"])

    async def fetch_blob(self, desc: dict[str, Any], out: IO[bytes], progress: Callable[[int], None]) -> None:
        n = self.layout.copy_blob(desc["digest"], out, progress)
        if n != desc["size"]:
            raise ImageError(f"{self.layout}: blob {desc['digest']} has {n} bytes, its descriptor says {desc['size']}")

    async def preflight(self) -> None:
        """Nothing to check: the layout directory is created on the first write."""

    async def put_blob(self, path: Path, digest: str, size: int, progress: Callable[[int], None]) -> None:
        self.layout.add_blob_file(path, digest)
        progress(size)

    async def put_bytes(self, data: bytes) -> None:
        self.layout.write_blob(data)

    async def put_manifest(self, data: bytes, media_type: str, *, tag: bool) -> None:
        self.layout.write_blob(data)
        if tag:
            self.layout.tag(self.tag, descriptor(media_type, data))


class _RegistryEnd:
    def __init__(self, spec: str, client: RegistryClient, plain_http: bool) -> None:
        self.ref: Reference = parse_reference(spec)
        self.client = client
        self.pusher = RegistryPusher(client)
        self.name = str(self.ref)
        if plain_http:
            client.use_plain_http(self.ref.registry)

    async def root(self) -> tuple[dict[str, Any], bytes]:
        m = await self.client.fetch_manifest(self.ref)
        d = m.descriptor
        return {"mediaType": d.media_type, "digest": d.digest, "size": d.size}, m.content

    async def read_json(self, desc: dict[str, Any]) -> bytes:
        mt = desc.get("mediaType", "")
        if mt in INDEX_TYPES or mt in MANIFEST_TYPES:
            m = await self.client.fetch_manifest(self.ref, Descriptor(mt, desc["digest"], desc["size"]))
            return m.content
        return await read_json_blob(self.client, self.ref, desc["digest"], desc["size"])

    async def fetch_blob(self, desc: dict[str, Any], out: IO[bytes], progress: Callable[[int], None]) -> None:
        await pull_blob(self.client, self.ref, desc["digest"], desc["size"], out, progress)

    async def preflight(self) -> None:
        """Fail before converting anything when DST cannot be reached or refuses us (a HEAD that
        needs the pull,push scope)."""
        await self.pusher.blob_exists(self.ref, sha256_digest(b""))

    async def put_blob(self, path: Path, digest: str, size: int, progress: Callable[[int], None]) -> None:
        await self.pusher.push_blob(self.ref, digest, size, path, progress)

    async def put_bytes(self, data: bytes) -> None:
        await self.pusher.push_blob(self.ref, sha256_digest(data), len(data), data)

    async def put_manifest(self, data: bytes, media_type: str, *, tag: bool) -> None:
        await self.pusher.push_manifest(self.ref, data, media_type,
                                        (self.ref.tag or "latest") if tag else sha256_digest(data))


def _endpoint(spec: str, client: RegistryClient | None, options: ConvertOptions,
              role: str) -> _LayoutEnd | _RegistryEnd:
    try:
        if is_layout_spec(spec):
            return _LayoutEnd(spec)
        assert client is not None
        return _RegistryEnd(spec, client, options.plain_http)
    except (ImageError, ValueError) as e:
        raise ConvertError(f"{role} {spec!r}: {e}; give a registry reference (HOST/REPO:TAG) or oci:DIR:TAG") from None


# ---- progress -------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class _Progress:
    """Per-step "label: done / total" lines on stderr, rewritten in place, at most 10 times a second."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

    def step(self, label: str, total: int) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        state = {"done": 0, "shown": 0.0, "finished": False}

        def advance(n: int) -> None:
            state["done"] += n
            now = time.monotonic()
            end = state["done"] >= total
            if state["finished"] or (not end and now - state["shown"] < 0.1):
                return
            state["shown"] = now
            self.stream.write(f"\r{label}: {_human(min(state['done'], total))} / {_human(total)}")
            if end:
                state["finished"] = True
                self.stream.write("\n")
            self.stream.flush()

        advance(0)
        return advance


class _Tracked(io.RawIOBase):
    """A seekable read-only view of a file that reports the furthest position read."""

    def __init__(self, f: BinaryIO, progress: Callable[[int], None]) -> None:
        self._f: Any = f
        self._progress = progress
        self._high = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        pos = self._f.tell()
        if pos > self._high:
            self._progress(pos - self._high)
            self._high = pos
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def _tracked(f: BinaryIO, progress: Callable[[int], None]) -> BinaryIO:
    return cast(BinaryIO, io.BufferedReader(_Tracked(f, progress), buffer_size=_PIECE))


# ---- layers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _failing_as(what: str, hint: str = "") -> Iterator[None]:
    """Turn the errors a step can raise into ConvertError prefixed with `what`."""
    try:
        yield
    except ConvertError:
        raise
    except (FormatError, ImageError, FetchError, ValueError, OSError, EOFError, zlib.error,
            zstandard.ZstdError, tarfile.TarError) as e:
        raise ConvertError(f"{what}: {e}{hint}") from e


def _decompress(src: Path, dst: Path, progress: Callable[[int], None]) -> tuple[str, int]:
    """Write the uncompressed layer (gzip / zstd / plain tar, sniffed) to dst; (sha256 digest, size)."""
    h = hashlib.sha256()
    size = 0
    with open(src, "rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        tracked = _tracked(raw, progress)
        reader: IO[bytes]
        if magic[:2] == b"\x1f\x8b":
            reader = cast(IO[bytes], gzip.GzipFile(fileobj=tracked, mode="rb"))
        elif magic == b"\x28\xb5\x2f\xfd":
            reader = cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(tracked, read_across_frames=True))
        else:
            reader = tracked
        with reader, open(dst, "wb") as out:
            while piece := reader.read(_PIECE):
                h.update(piece)
                out.write(piece)
                size += len(piece)
    return "sha256:" + h.hexdigest(), size


def _tar_names(path: Path) -> set[str]:
    """Normalized names of every member (also proves the file is a readable tar)."""
    names: set[str] = set()
    with tarfile.open(path, mode="r:", errors="surrogateescape") as tf:
        for m in tf:
            names.add(normalize_name(m.name))
    return names


def _keep_annotations(desc: dict[str, Any]) -> dict[str, str]:
    ann = desc.get("annotations") or {}
    return {k: v for k, v in ann.items() if isinstance(k, str) and isinstance(v, str)
            and not k.startswith(_STALE_ANNOTATION_PREFIXES)}


def _layer_descriptor(layer: ConvertedLayer) -> dict[str, Any]:
    d: dict[str, Any] = {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
    if layer.annotations:
        d["annotations"] = dict(layer.annotations)
    return d


def _bootstrap_tar(bootstrap: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        d = tarfile.TarInfo("image")
        d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 0
        tf.addfile(d)
        f = tarfile.TarInfo(BOOTSTRAP_NAME)
        f.mode, f.mtime, f.size = 0o644, 0, len(bootstrap)
        tf.addfile(f, io.BytesIO(bootstrap))
    return buf.getvalue()


class _Converter:
    def __init__(self, src: _Source, dst: _Sink, options: ConvertOptions, work: Path, progress: _Progress) -> None:
        self.src = src
        self.dst = dst
        self.opts = options
        self.work = work
        self.progress = progress
        self.chunk_size = options.chunk_size or DEFAULT_CHUNK_SIZE[options.format]
        # The order the writers lay the prefetch list's files out in (module docstring).
        self.prefetch_order = startup_files_first(options.prefetch) if options.prefetch is not None else None
        self._done: dict[str, ConvertedLayer] = {}  # source layer digest -> result (estargz/zstd)

    async def run(self) -> ConvertResult:
        with _failing_as(f"cannot read source image {self.src.name}",
                         "; check the reference/tag exists and is reachable (--plain-http for an HTTP registry)"):
            desc, data = await self.src.root()
        with _failing_as(f"cannot write to {self.dst.name}", _PUSH_HINT):
            await self.dst.preflight()
        doc = decode(data, f"image {self.src.name}")
        mt = media_type_of(doc, desc.get("mediaType", ""))
        if mt in INDEX_TYPES:
            return await self._index(doc)
        if mt not in MANIFEST_TYPES:
            raise ConvertError(f"image {self.src.name}: media type {mt!r} is neither an image manifest nor an index")
        cm, blob = await self._manifest(doc, self.src.name, "")
        with _failing_as(f"writing the manifest of {self.dst.name}", _PUSH_HINT):
            await self.dst.put_manifest(blob, OCI_MANIFEST, tag=True)
        return ConvertResult(cm.digest, OCI_MANIFEST, cm.size, (cm,))

    async def _index(self, doc: dict[str, Any]) -> ConvertResult:
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise ConvertError(f"image {self.src.name}: index has no 'manifests' list")
        out_entries: list[dict[str, Any]] = []
        converted: list[ConvertedManifest] = []
        for i, raw in enumerate(entries):
            with _failing_as(f"image {self.src.name}: index entry {i}"):
                e = check_descriptor(raw, "descriptor")
            plat = platform_text(e)
            mt = e.get("mediaType", "")
            if mt in INDEX_TYPES:
                raise ConvertError(f"image {self.src.name}: index entry {i} ({e['digest']}) is itself an index; "
                                   "nested indexes are not supported - convert that index by digest instead")
            if mt not in MANIFEST_TYPES or is_attestation(e):
                log.warning("image %s: skipping index entry %d (%s, %s, %s): not an image manifest",
                            self.src.name, i, e["digest"], mt or "no media type", plat)
                continue
            label = f"{self.src.name} [{plat}]"
            self.progress.note(f"converting {label} manifest {e['digest']}")
            with _failing_as(f"image {label}: manifest {e['digest']}"):
                data = await self.src.read_json(e)
                if sha256_digest(data) != e["digest"]:
                    raise ImageError(f"content hashes to {sha256_digest(data)}")
            cm, blob = await self._manifest(decode(data, f"image {label} manifest"), label, plat)
            with _failing_as(f"writing manifest {cm.digest} to {self.dst.name}", _PUSH_HINT):
                await self.dst.put_manifest(blob, OCI_MANIFEST, tag=False)
            entry: dict[str, Any] = {"mediaType": OCI_MANIFEST, "digest": cm.digest, "size": cm.size}
            for key in ("platform", "annotations"):
                if key in e:
                    entry[key] = e[key]
            out_entries.append(entry)
            converted.append(cm)
        if not out_entries:
            raise ConvertError(f"image {self.src.name}: the index lists no image manifest to convert")
        index: dict[str, Any] = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": out_entries}
        if isinstance(doc.get("annotations"), dict):
            index["annotations"] = doc["annotations"]
        blob = encode(index)
        with _failing_as(f"writing the index of {self.dst.name}", _PUSH_HINT):
            await self.dst.put_manifest(blob, OCI_INDEX, tag=True)
        return ConvertResult(sha256_digest(blob), OCI_INDEX, len(blob), tuple(converted))

    async def _manifest(self, doc: dict[str, Any], label: str, plat: str) -> tuple[ConvertedManifest, bytes]:
        with _failing_as(f"image {label}: manifest"):
            config_desc = check_descriptor(doc.get("config"), "config descriptor")
            layers = doc.get("layers")
            if not isinstance(layers, list) or not layers:
                raise ImageError("manifest has no layers")
            for i, layer in enumerate(layers):
                check_descriptor(layer, f"layer {i + 1}")
        with _failing_as(f"image {label}: config {config_desc['digest']}"):
            config = decode(await self.src.read_json(config_desc), "config")
            rootfs = config.get("rootfs")
            diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
            if not isinstance(rootfs, dict) or not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
                raise ImageError(f"rootfs.diff_ids has {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
                                 f"entries for {len(layers)} layers")
        if self.opts.format == "nydus":
            new_layers = await self._nydus(layers, diff_ids, label)
            history = config.get("history")
            if isinstance(history, list):
                config["history"] = [*history, {"created_by": "snapshotter convert --format nydus",
                                                "comment": "Nydus RAFS v6 bootstrap"}]
        else:
            new_layers = []
            for i, layer in enumerate(layers):
                new_layers.append(await self._layer(i, len(layers), layer, diff_ids[i], label))
        config["rootfs"] = {**rootfs, "diff_ids": [layer.diff_id for layer in new_layers]}
        config_blob = encode(config)
        with _failing_as(f"writing the config of {label} to {self.dst.name}", _PUSH_HINT):
            await self.dst.put_bytes(config_blob)
        config_mt = config_desc.get("mediaType") or OCI_CONFIG
        manifest: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG if config_mt == DOCKER_CONFIG else config_mt,
                       "digest": sha256_digest(config_blob), "size": len(config_blob)},
            "layers": [_layer_descriptor(layer) for layer in new_layers],
        }
        if isinstance(doc.get("annotations"), dict):
            manifest["annotations"] = doc["annotations"]
        blob = encode(manifest)
        cm = ConvertedManifest(plat, sha256_digest(blob), len(blob), sha256_digest(config_blob), tuple(new_layers))
        return cm, blob

    async def _layer_tar(self, i: int, n: int, layer: dict[str, Any], diff_id: object, label: str) -> Path:
        """Download and decompress layer i into a temp tar, checked against the config's diff_id."""
        digest = layer["digest"]
        what = f"image {label}: layer {i + 1}/{n} ({digest})"
        mt = layer.get("mediaType", "")
        if mt not in TAR_LAYER_TYPES:
            raise ConvertError(f"{what}: media type {mt!r} is not a tar layer and cannot be converted "
                               "(for an already converted image, convert its original instead)")
        hexpart = digest.split(":", 1)[1]
        blob = self.work / f"src-{hexpart}"
        tar = self.work / f"tar-{hexpart}"
        with _failing_as(f"{what}: download", "; check the registry/layout holds this blob"):
            with open(blob, "wb") as f:
                await self.src.fetch_blob(layer, f, self.progress.step(f"layer {i + 1}/{n} pull", layer["size"]))
        with _failing_as(f"{what}: decompressing", "; the layer blob is not valid gzip/zstd/tar data - "
                         "rebuild or re-push the source image"):
            got, _ = _decompress(blob, tar, self.progress.step(f"layer {i + 1}/{n} unpack", layer["size"]))
        blob.unlink()
        if got != diff_id:
            raise ConvertError(f"{what}: uncompressed content hashes to {got}, but the config's diff_id is "
                               f"{diff_id}; the source image is inconsistent - rebuild or re-push it")
        return tar

    def _layer_names(self, tar: Path, what: str) -> set[str]:
        with _failing_as(f"{what}: not a valid tar archive", "; the source layer must be a tar (rebuild the image)"):
            return _tar_names(tar)

    async def _layer(self, i: int, n: int, layer: dict[str, Any], diff_id: object, label: str) -> ConvertedLayer:
        digest = layer["digest"]
        if digest in self._done:
            return self._done[digest]
        what = f"image {label}: layer {i + 1}/{n} ({digest})"
        tar = await self._layer_tar(i, n, layer, diff_id, label)
        names = self._layer_names(tar, what)
        prefetch = [p for p in self.prefetch_order or () if p in names]
        out = self.work / f"out-{digest.split(':', 1)[1]}"
        step = self.progress.step(f"layer {i + 1}/{n} convert to {self.opts.format}", tar.stat().st_size)
        with _failing_as(f"{what}: converting to {self.opts.format}", "; the layer tar is malformed"):
            with open(tar, "rb") as raw, open(out, "wb") as o:
                src = _tracked(raw, step)
                if self.opts.format == "estargz":
                    er = write_estargz(src, o, chunk_size=self.chunk_size, prefetch=prefetch)
                    result = ConvertedLayer(digest, er.digest, er.size, OCI_LAYER_GZIP, er.diff_id,
                                            {**_keep_annotations(layer), **er.annotations()})
                else:
                    zr = write_zstdchunked(src, o, chunk_size=self.chunk_size, prefetch=prefetch)
                    result = ConvertedLayer(digest, zr.blob_digest, zr.blob_size, OCI_LAYER_ZSTD, zr.diff_id,
                                            {**_keep_annotations(layer), **zr.annotations})
        tar.unlink()
        with _failing_as(f"{what}: writing converted blob {result.digest} to {self.dst.name}", _PUSH_HINT):
            await self.dst.put_blob(out, result.digest, result.size,
                                    self.progress.step(f"layer {i + 1}/{n} push", result.size))
        out.unlink()
        self._done[digest] = result
        return result

    async def _nydus(self, layers: list[dict[str, Any]], diff_ids: list[Any], label: str) -> list[ConvertedLayer]:
        n = len(layers)
        tars: list[Path] = []
        for i, layer in enumerate(layers):
            tar = await self._layer_tar(i, n, layer, diff_ids[i], label)
            self._layer_names(tar, f"image {label}: layer {i + 1}/{n} ({layer['digest']})")
            tars.append(tar)
        blob_paths = [self.work / f"nydus-blob-{i}" for i in range(n)]
        step = self.progress.step(f"nydus build ({n} layers)", sum(t.stat().st_size for t in tars))
        with _failing_as(f"image {label}: building the Nydus image", "; a layer tar is malformed"):
            with contextlib.ExitStack() as stack:
                streams = [_tracked(stack.enter_context(open(t, "rb")), step) for t in tars]

                def blob_out(i: int) -> BinaryIO:
                    return stack.enter_context(open(blob_paths[i], "wb"))

                result = write_nydus(streams, blob_out, chunk_size=self.chunk_size, compression="zstd",
                                     prefetch=self.prefetch_order or None)
        for t in tars:
            t.unlink()
        out: list[ConvertedLayer] = []
        for i, path in enumerate(blob_paths):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while piece := f.read(_PIECE):
                    h.update(piece)
            digest = "sha256:" + h.hexdigest()
            size = path.stat().st_size
            if digest != "sha256:" + result.blob_ids[i]:  # the bootstrap names blobs by this id
                raise ConvertError(f"image {label}: Nydus blob {i} has digest {digest} but blob id "
                                   f"{result.blob_ids[i]} (writer bug)")
            blob_layer = ConvertedLayer(layers[i]["digest"], digest, size, NYDUS_BLOB, digest,
                                        {NYDUS_BLOB_ANNOTATION: "true"})
            with _failing_as(f"image {label}: writing Nydus blob {digest} (layer {i + 1}/{n}) to {self.dst.name}",
                             _PUSH_HINT):
                await self.dst.put_blob(path, digest, size, self.progress.step(f"blob {i + 1}/{n} push", size))
            os.unlink(path)
            out.append(blob_layer)
        boot_tar = _bootstrap_tar(result.bootstrap)
        boot_gz = gzip.compress(boot_tar, mtime=0)
        ann = {NYDUS_BOOTSTRAP_ANNOTATION: "true", NYDUS_FS_VERSION_ANNOTATION: "6",
               NYDUS_BLOB_IDS_ANNOTATION: json.dumps(list(result.blob_ids), separators=(",", ":"))}
        boot = ConvertedLayer(None, sha256_digest(boot_gz), len(boot_gz), OCI_LAYER_GZIP, sha256_digest(boot_tar), ann)
        with _failing_as(f"image {label}: writing the Nydus bootstrap layer to {self.dst.name}", _PUSH_HINT):
            await self.dst.put_bytes(boot_gz)
        out.append(boot)
        return out
