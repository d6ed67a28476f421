"""`snapshotter status`: what the running daemon serves, per image and per layer.

The daemon builds the document (`build_status`) and answers it on its admin socket
(snapshotter/admin.py); the command fetches it and prints it as text or JSON.

Document, version 1:
    {"version": 1, "time": EPOCH, "daemon": {"pid", "root", "address"},
     "cache": {"bytes", "chunks", "max_bytes"} | {"error"},
     "images": [{"image": REF,
                 "layers": [{"digest", "snapshot", "state": "lazy" | "local" | "fallback",
                             "format"?, "reason"?, "error"?, "fallback_time"?,
                             "size"?,            # compressed layer size when known
                             "fetched_bytes"?, "fetched_bytes_by_cause"?, "prefetch"?}],   # bottom layer first
                 "mounts": [MOUNT ids]}],
     "mounts": [{"id", "pid", "alive", "health": "ok" | "stale" | "dead", "stats_age_seconds"?,
                 "images": [REF], "layers": N,
                 "metadata_image": BOOL}]}     # its metadata image is mounted (remote/metaimages.py)
A layer is "lazy" when its committed snapshot is a remote snapshot, "fallback" when it is an
ordinary snapshot and a fallback was recorded for its digest (ROOT/layers/<hex>/fallback.json),
"local" otherwise (a layer without remote labels, pulled the ordinary way).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapshotter.mountinfo import is_mountpoint
from snapshotter.remote.labels import CRI_IMAGE_REF, CRI_LAYER_DIGEST, REMOTE_LABEL, STARGZ_DIGEST, STARGZ_REFERENCE
from snapshotter.remote.metaimages import META_DIR
from snapshotter.remote.mountstats import mount_stats, read_json
from snapshotter.remote.store import LayerStore
from snapshotter.snapshots.model import Info, Kind

STATUS_VERSION = 1
STALE_SECONDS = 10.0  # a mount process rewrites stats.json every second


def _chain_depth(info: Info, by_name: dict[str, Info]) -> int:
    depth, seen, parent = 0, set(), info.parent
    while parent and parent in by_name and parent not in seen:
        seen.add(parent)
        depth += 1
        parent = by_name[parent].parent
    return depth


def build_status(infos: list[Info], layers: LayerStore, mounts_dir: Path,
                 alive: Callable[[str], bool], pids: dict[str, int | None],
                 cache_usage: Callable[[], tuple[int, int]] | None, cache_max_bytes: int,
                 daemon: dict[str, Any]) -> dict[str, Any]:
    """The status document (see the module docstring) from the daemon's live objects."""
    now = time.time()
    stats = mount_stats(mounts_dir)
    layer_stats: dict[str, list[dict[str, Any]]] = {}
    prefetch_state: dict[str, Any] = {}  # layer digest -> the mount's prefetch state of it (fusefs/prefetch.py)
    for doc in stats.values():
        for entry in doc.get("layers", []):
            layer_stats.setdefault(str(entry.get("digest", "")), []).append(entry)
        prefetch = doc.get("prefetch")
        if isinstance(prefetch, dict) and isinstance(prefetch.get("layers"), dict):
            for key, state in prefetch["layers"].items():  # keyed "POSITION:DIGEST"; the value names the layer
                if isinstance(state, dict):
                    prefetch_state[str(state.get("layer") or key)] = state

    mounts: list[dict[str, Any]] = []
    image_mounts: dict[str, list[str]] = {}
    for mount_id in sorted(pids, key=int):
        state = read_json(mounts_dir / mount_id / "state.json") or {}
        refs = sorted({str(layer.get("reader", {}).get("image_ref", "")) for run in state.get("runs", [])
                       for layer in run if isinstance(layer, dict)} - {""})
        is_alive = alive(mount_id)
        m: dict[str, Any] = {"id": mount_id, "pid": pids[mount_id], "alive": is_alive, "images": refs,
                             "layers": sum(len(run) for run in state.get("runs", [])),
                             "metadata_image": is_mountpoint(mounts_dir / mount_id / META_DIR)}
        sdoc = stats.get(mount_id)
        age = now - float(sdoc.get("time", 0)) if sdoc else None
        if age is not None:
            m["stats_age_seconds"] = round(age, 3)
        m["health"] = "dead" if not is_alive else ("ok" if age is not None and age < STALE_SECONDS else "stale")
        mounts.append(m)
        for ref in refs:
            image_mounts.setdefault(ref, []).append(mount_id)

    by_name = {i.name: i for i in infos}
    images: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for info in infos:
        if info.kind is not Kind.COMMITTED:
            continue
        digest = info.labels.get(CRI_LAYER_DIGEST) or info.labels.get(STARGZ_DIGEST)
        if not digest:
            continue
        image = info.labels.get(CRI_IMAGE_REF) or info.labels.get(STARGZ_REFERENCE) or ""
        layer: dict[str, Any] = {"digest": digest, "snapshot": info.name}
        if REMOTE_LABEL in info.labels:
            layer["state"] = "lazy"
            layer["format"] = info.labels[REMOTE_LABEL]
            meta = layers.meta(digest)
            if meta is not None:
                layer["size"] = meta.blob_size
            entries = layer_stats.get(digest, [])
            if entries:
                layer["fetched_bytes"] = sum(int(e.get("fetched_bytes", 0)) for e in entries)
                causes: dict[str, int] = {}
                for e in entries:
                    for cause, n in (e.get("fetched_bytes_by_cause") or {}).items():
                        causes[cause] = causes.get(cause, 0) + int(n)
                layer["fetched_bytes_by_cause"] = causes
            else:
                layer["fetched_bytes"] = 0
            if digest in prefetch_state:
                layer["prefetch"] = prefetch_state[digest]
        else:
            try:
                fallback = layers.fallback(digest)
            except ValueError:
                fallback = None
            if fallback is not None:
                layer.update(state="fallback", reason=fallback.get("reason", ""), error=fallback.get("error", ""),
                             fallback_time=fallback.get("time"))
            else:
                layer["state"] = "local"
        images.setdefault(image, []).append((_chain_depth(info, by_name), layer))

    cache: dict[str, Any]
    if cache_usage is None:
        cache = {"error": "no cache"}
    else:
        try:
            used, chunks = cache_usage()
            cache = {"bytes": used, "chunks": chunks, "max_bytes": cache_max_bytes}
        except Exception as exc:  # status must answer even when the cache is broken
            cache = {"error": str(exc)}
    return {
        "version": STATUS_VERSION, "time": now, "daemon": daemon, "cache": cache,
        "images": [{"image": ref, "layers": [layer for _d, layer in sorted(items, key=lambda x: x[0])],
                    "mounts": image_mounts.get(ref, [])} for ref, items in sorted(images.items())],
        "mounts": mounts,
    }


def _size(n: int | float | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _phase(pf: dict[str, Any], name: str) -> str:
    """'done (1.2 MiB)' / 'skipped (no_prefetch_files)' for one phase of a layer's prefetch state."""
    state = str(pf.get(name, "?"))
    reason = pf.get(f"{name}_reason")
    if reason:
        return f"{state} ({reason})"
    nbytes = pf.get(f"{name}_bytes")
    return f"{state} ({_size(nbytes)})" if nbytes else state


def render_text(doc: dict[str, Any]) -> str:
    """Human-readable status: one block per image, then the mounts and the cache."""
    lines: list[str] = []
    for image in doc.get("images", []):
        lines.append(f"image {image['image'] or '(unknown image)'}")
        for layer in image["layers"]:
            state = layer["state"]
            if state == "lazy":
                what = f"lazy ({layer.get('format', '?')}), fetched {_size(layer.get('fetched_bytes'))}" \
                       f" of {_size(layer.get('size'))}"
                pf = layer.get("prefetch")
                if isinstance(pf, dict):
                    what += f", prefetch {_phase(pf, 'prefetch')}, background {_phase(pf, 'background')}"
            elif state == "fallback":
                what = f"fell back ({layer.get('reason', '?')}): pulled in full"
            else:
                what = "local (pulled in full, no lazy format)"
            lines.append(f"  layer {layer['digest']}  {what}")
        for mount_id in image.get("mounts", []):
            lines.append(f"  mount {mount_id}")
    lines.append("mounts:" if doc.get("mounts") else "mounts: none")
    for m in doc.get("mounts", []):
        lines.append(f"  {m['id']}  pid {m.get('pid')}  {m['health']}  layers {m['layers']}  "
                     f"images {', '.join(m['images'])}"
                     + ("  (metadata image mounted)" if m.get("metadata_image") else ""))
    cache = doc.get("cache", {})
    if "error" in cache:
        lines.append(f"cache: unavailable ({cache['error']})")
    else:
        lines.append(f"cache: {_size(cache['bytes'])} in {cache['chunks']} chunks (cap {_size(cache['max_bytes'])})")
    return "\n".join(lines) + "\n"


def admin_socket_path(address: str | os.PathLike[str]) -> Path:
    """The admin socket next to the gRPC socket `address`."""
    return Path(f"{os.fspath(address)}.admin")


def fetch_status(admin_path: Path, timeout: float = 10.0) -> dict[str, Any]:
    """GET /status over the admin socket; OSError / ValueError when the daemon does not answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(admin_path))
        s.sendall(b"GET /status HTTP/1.0\r\nHost: snapshotter\r\n\r\n")
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split()
    if len(parts) < 2 or parts[1] != "200":
        raise ValueError(f"admin socket {admin_path} answered {status_line!r}: {body[:200]!r}")
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError(f"admin socket {admin_path}: not a JSON object")
    return doc
