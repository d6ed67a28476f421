"""`snapshotter inspect FILE_OR_REF`: a layer's index as JSON.

FILE: a layer blob on disk (eStargz, legacy stargz, zstd:chunked) or a Nydus RAFS v6 bootstrap
(raw, or the bootstrap layer tar that holds image/image.boot). REF: an image in a registry; every
layer of its manifest is resolved the way the daemon would (footer + TOC ranges only).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from snapshotter.config import Config
from snapshotter.errors import FormatError, SnapshotterError
from snapshotter.formats import estargz, zstdchunked
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.nydus import parse_bootstrap
from snapshotter.formats.nydus_layer import bootstrap_from_layer
from snapshotter.formats.tail_hint import TAIL_SIZE_ANNOTATION, parse_tail_size

EROFS_MAGIC_AT_1024 = b"\xe2\xe1\xf5\xe0"


def index_to_json(index: LayerIndex) -> dict[str, Any]:
    return {
        "format": index.format,
        "blobs": list(index.blobs),
        "toc_digest": index.toc_digest,
        "landmark": index.landmark.value,
        "prefetch": list(index.prefetch),
        "entries": [
            {
                "name": e.name, "type": e.type.value, "mode": oct(e.mode), "uid": e.uid, "gid": e.gid,
                "mtime_ns": e.mtime_ns, "size": e.size, "nlink": e.nlink,
                **({"link": e.link_target} if e.link_target else {}),
                **({"dev": [e.dev_major, e.dev_minor]} if e.dev_major or e.dev_minor else {}),
                **({"xattrs": sorted(e.xattrs)} if e.xattrs else {}),
                **({"digest": e.digest} if e.digest else {}),
                **({"chunks": [
                    {"offset": c.file_offset, "size": c.size, "blob_offset": c.blob_offset,
                     "blob_size": c.blob_size, "compression": c.compression.value, "digest": c.digest,
                     **({"inner_offset": c.inner_offset} if c.inner_offset else {}),
                     **({"blob_index": c.blob_index} if c.blob_index else {})}
                    for c in e.chunks]} if e.chunks else {}),
            }
            for e in index.entries
        ],
    }


def index_of_file(path: Path, config: Config) -> LayerIndex:
    """Parse a local blob or bootstrap. Raises FormatError naming the file when nothing fits."""
    data = path.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    limits = config.limits
    errors: list[str] = []
    if len(data) > 1028 and data[1024:1028] == EROFS_MAGIC_AT_1024:
        return parse_bootstrap(data, max_bootstrap_bytes=limits.max_bootstrap_bytes)
    try:
        footer = estargz.parse_footer(data[-estargz.FOOTER_SIZE:])
        off, length = estargz.toc_range(footer, len(data))
        return estargz.parse_toc(data[off:off + length], blob_size=len(data), layer_digest=digest,
                                 max_toc_bytes=limits.max_toc_bytes, toc_offset=footer.toc_offset)
    except FormatError as exc:
        errors.append(f"eStargz: {exc}")
    try:
        pos = zstdchunked.parse_footer(data[-zstdchunked.FOOTER_SIZE:], blob_size=len(data))
        return zstdchunked.parse_manifest(data[pos.offset:pos.offset + pos.compressed_size], blob_size=len(data),
                                          layer_digest=digest, max_toc_bytes=limits.max_toc_bytes, position=pos)
    except FormatError as exc:
        errors.append(f"zstd:chunked: {exc}")
    try:
        boot = bootstrap_from_layer(data, max_bootstrap_bytes=limits.max_bootstrap_bytes)
        return parse_bootstrap(boot, max_bootstrap_bytes=limits.max_bootstrap_bytes)
    except FormatError as exc:
        errors.append(f"nydus: {exc}")
    raise FormatError(f"{path}: not an eStargz, zstd:chunked or Nydus layer ({'; '.join(errors)})")


async def _inspect_ref(ref: str, config: Config) -> list[dict[str, Any]]:
    from snapshotter.fetch.client import RegistryClient
    from snapshotter.remote.labels import LayerRef
    from snapshotter.remote.resolver import NotLazy, resolve_layer
    from snapshotter.remote.settings import fetch_config_from

    out: list[dict[str, Any]] = []
    async with RegistryClient(fetch_config_from(config)) as client:
        manifest = (await client.fetch_manifest(ref)).json()
        if "manifests" in manifest:
            raise SnapshotterError(f"{ref} is an image index; inspect one platform's manifest by digest "
                                   f"({', '.join(m['digest'] for m in manifest['manifests'])})")
        for layer in manifest.get("layers", []):
            ann = layer.get("annotations", {})
            lref = LayerRef(ref, layer["digest"], (), None, ann.get("containerd.io/snapshot/stargz/toc.digest"),
                            False, False, "inspect", tail_size=parse_tail_size(ann.get(TAIL_SIZE_ANNOTATION)))
            item: dict[str, Any] = {"digest": layer["digest"], "mediaType": layer.get("mediaType"),
                                    "size": layer.get("size"), "annotations": ann}
            try:
                resolved = await resolve_layer(client, lref, max_toc_bytes=config.limits.max_toc_bytes)
                item["lazy"] = True
                item["index"] = index_to_json(resolved.index)
            except (NotLazy, FormatError) as exc:
                item["lazy"] = False
                item["reason"] = str(exc)
            out.append(item)
    return out


def inspect(target: str, config: Config) -> dict[str, Any]:
    path = Path(target)
    if path.exists():
        return {"file": str(path), "index": index_to_json(index_of_file(path, config))}
    import trio

    return {"reference": target, "layers": trio.run(_inspect_ref, target, config)}
