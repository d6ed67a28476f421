"""The mount process's statistics file, read by the daemon's /metrics and `snapshotter status`.

The state file may name a `stats_file` (the daemon uses ROOT/mounts/<id>/stats.json). While the
mount serves, `run_stats_writer` rewrites it atomically every `interval` seconds and once more
when it is cancelled (the mount process stopping). Counters are totals since the process
started; a reader of the file treats a new `pid` as a counter reset.

Document, version 1 (unknown keys must be ignored by readers):
    {"version": 1, "pid": P, "started": EPOCH, "time": EPOCH, "mountpoint": M,
     "fuse": {"reads", "read_bytes", "read_errors", "read_timeouts", "unexpected_errors",
              "demand_chunks", "demand_chunk_bytes",      # distinct chunks reads touched (compressed bytes)
              "latency_buckets": [bound seconds...],
              "ops": {OP: {"count", "errors", "seconds", "buckets": [per bucket, last is +Inf]}}},
     "layers": [{"digest", "image", "registry", "format", "blob_size", "requests", "fetched_bytes",
                 "fetched_bytes_by_cause": {"on_demand", "prefetch", "background"},
                 "cache_hits", "cache_misses", "chunks_fetched", "refetches", "readahead_chunks",
                 "readahead_warmed", "amplified_chunks"} ...],   # state order
     "registry": {"requests", "retries", "bytes_received", "bytes_by_host": {HOST: N}},
                 # the mount's registry client and, live, the spare's early prefetches of its layers
     "cache": {"evicted_chunks", "evicted_bytes"}}
Other parts of the mount process add fields by putting a callable `() -> dict` into
`env.shared["stats_hooks"]` (a list); its result is merged into the top level of the document
(e.g. {"prefetch": {...}}).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from snapshotter.fetch.client import FetchStatistics
from snapshotter.fusefs.ops import LATENCY_BUCKETS, LazyOperations

log = logging.getLogger(__name__)

STATS_VERSION = 1
STATS_HOOKS = "stats_hooks"
# env.shared key: the spare's early prefetches of the mount's layers (fusefs/early.py); what their
# registry clients received (`registry_stats_so_far()`, so far while they run) is the mount's too.
EARLY_PREFETCHES = "early_prefetches"


def _registry_of(image_ref: str) -> str:
    from snapshotter.fetch.reference import parse_reference

    try:
        return parse_reference(image_ref).registry
    except Exception:  # a label we cannot parse still gets its bytes counted
        return ""


def stats_document(state: Any, ops: LazyOperations, readers: Sequence[object],
                   shared: dict[str, Any], started: float) -> dict[str, Any]:
    """The statistics document (see the module docstring) of a serving mount."""
    fs = ops.stats
    doc: dict[str, Any] = {
        "version": STATS_VERSION, "pid": os.getpid(), "started": started, "time": time.time(),
        "mountpoint": state.mountpoint,
        "fuse": {
            "reads": fs.reads, "read_bytes": fs.read_bytes, "read_errors": fs.read_errors,
            "read_timeouts": fs.read_timeouts, "unexpected_errors": fs.unexpected_errors,
            "demand_chunks": fs.demand_chunks, "demand_chunk_bytes": fs.demand_chunk_bytes,
            "latency_buckets": list(LATENCY_BUCKETS),
            "ops": {op: {"count": s.count, "errors": s.errors, "seconds": s.seconds, "buckets": list(s.buckets)}
                    for op, s in sorted(fs.ops.items())},
        },
    }
    layers = []
    specs = [spec for run in state.runs for spec in run]
    for spec, reader in zip(specs, readers, strict=False):
        image = str(spec.reader.get("image_ref", ""))
        layer: dict[str, Any] = {
            "digest": spec.digest or str(spec.reader.get("layer_digest", "")), "image": image,
            "registry": _registry_of(image) if image else "", "format": str(spec.reader.get("format", "")),
            "blob_size": int(spec.reader.get("blob_size", 0) or 0),
        }
        rs = getattr(reader, "stats", None)
        if rs is not None:
            layer.update(requests=rs.requests, fetched_bytes=rs.fetched_bytes,
                         fetched_bytes_by_cause=dict(rs.fetched_bytes_by_cause), cache_hits=rs.cache_hits,
                         cache_misses=rs.cache_misses, chunks_fetched=rs.chunks_fetched, refetches=rs.refetches,
                         readahead_chunks=rs.readahead_chunks, readahead_warmed=rs.readahead_warmed,
                         amplified_chunks=rs.amplified_chunks)
        layers.append(layer)
    doc["layers"] = layers
    client = shared.get("registry_client")
    if client is not None:
        st = FetchStatistics()
        st.add(client.stats)
        for early in shared.get(EARLY_PREFETCHES, ()):
            st.add(early.registry_stats_so_far())
        doc["registry"] = {"requests": st.requests, "retries": st.retries, "bytes_received": st.bytes_received,
                           "bytes_by_host": dict(st.bytes_by_host)}
    cache = shared.get("chunk_cache")
    if cache is not None:
        doc["cache"] = {"evicted_chunks": cache.evicted_chunks, "evicted_bytes": cache.evicted_bytes}
    hooks: list[Callable[[], dict[str, Any]]] = shared.get(STATS_HOOKS, [])
    for hook in hooks:
        try:
            doc.update(hook())
        except Exception as exc:  # statistics must never take the mount down
            log.warning("statistics hook %r failed: %s", hook, exc)
    return doc


def write_stats(path: str, doc: dict[str, Any]) -> None:
    """Write `doc` to `path` atomically (temp file in the same dir, then rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


async def run_stats_writer(state: Any, ops: LazyOperations, readers: Sequence[object], env: Any,
                           interval: float = 1.0) -> None:
    """Rewrite the state's `stats_file` every `interval` s and once more when cancelled.

    Does nothing when the state names no stats file. Write errors are logged once, not raised.
    """
    path = state.doc.get("stats_file")
    if not isinstance(path, str) or not path:
        return
    started = time.time()
    failed = False

    def write() -> None:
        nonlocal failed
        try:
            write_stats(path, stats_document(state, ops, readers, env.shared, started))
            failed = False
        except (OSError, ValueError) as exc:
            if not failed:
                log.warning("event=stats_write_failed path=%s error=%s", path, exc)
            failed = True

    try:
        while True:
            write()
            await trio.sleep(interval)
    finally:
        write()
