"""Reading the mount processes' statistics files (ROOT/mounts/<id>/stats.json, see
fusefs/stats.py) for the daemon: a Prometheus Collector that turns them into metrics at scrape
time, and the per-mount view `snapshotter status` shows.

Labels: `mount` (the mount id: the image's top snapshot id) and `image` (the image reference of
the mount's layers). Metric names are documented in docs/metrics.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from snapshotter.reader.causes import FETCH_CAUSES

log = logging.getLogger(__name__)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, partial or not an object."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def mount_stats(mounts_dir: Path) -> dict[str, dict[str, Any]]:
    """Mount id -> its stats document, for every mount dir that has a readable one."""
    out: dict[str, dict[str, Any]] = {}
    try:
        dirs = sorted(p for p in mounts_dir.iterdir() if p.is_dir() and p.name.isdigit())
    except OSError:
        return out
    for d in dirs:
        doc = read_json(d / "stats.json")
        if doc is not None:
            out[d.name] = doc
    return out


def image_of(doc: dict[str, Any]) -> str:
    images = sorted({str(layer.get("image", "")) for layer in doc.get("layers", []) if layer.get("image")})
    return ",".join(images)


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


class MountStatsCollector(Collector):
    """Metrics from every mount's stats.json plus the chunk cache's usage, read at scrape time."""

    def __init__(self, mounts_dir: Path, cache_usage: Any = None) -> None:
        self.mounts_dir = mounts_dir
        self.cache_usage = cache_usage  # () -> (bytes, chunks), or None

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at collect time; no registration-time check needed

    def collect(self) -> Iterator[Metric]:
        mlabels = ["mount", "image"]
        ops = CounterMetricFamily("snapshotter_fuse_operations", "FUSE requests answered, by operation",
                                  labels=[*mlabels, "op"])
        op_errors = CounterMetricFamily("snapshotter_fuse_operation_errors",
                                        "FUSE requests answered with an error, by operation", labels=[*mlabels, "op"])
        op_seconds = HistogramMetricFamily("snapshotter_fuse_operation_seconds",
                                           "FUSE request latency, by operation", labels=[*mlabels, "op"])
        served = CounterMetricFamily("snapshotter_fuse_read_bytes", "file bytes served to readers through FUSE",
                                     labels=mlabels)
        read_errors = CounterMetricFamily("snapshotter_fuse_read_errors",
                                          "FUSE reads answered EIO (fetch error or timeout)", labels=mlabels)
        fetched = CounterMetricFamily("snapshotter_fetched_bytes",
                                      "compressed layer bytes fetched from registries, by the image's registry "
                                      "and cause (on_demand, prefetch, background)",
                                      labels=[*mlabels, "registry", "cause"])
        by_host = CounterMetricFamily("snapshotter_registry_bytes_received",
                                      "response body bytes received by mount processes, by the host that sent "
                                      "them (a mirror or the origin)", labels=[*mlabels, "host"])
        requests = CounterMetricFamily("snapshotter_registry_requests", "registry requests by mount processes",
                                       labels=mlabels)
        hits = CounterMetricFamily("snapshotter_cache_hits", "chunk lookups answered by the on-disk cache",
                                   labels=mlabels)
        misses = CounterMetricFamily("snapshotter_cache_misses", "chunk lookups the cache could not answer",
                                     labels=mlabels)
        evictions = CounterMetricFamily("snapshotter_cache_evictions", "chunks evicted (LRU) to make room",
                                        labels=mlabels)
        evicted_bytes = CounterMetricFamily("snapshotter_cache_evicted_bytes", "bytes evicted to make room",
                                            labels=mlabels)
        direct_files = GaugeMetricFamily("snapshotter_direct_files",
                                         "big files stored whole and handed to overlayfs, which reads them from "
                                         "disk instead of through FUSE (fusefs/direct.py)", labels=mlabels)
        direct_bytes = GaugeMetricFamily("snapshotter_direct_bytes", "bytes of those files", labels=mlabels)
        for mount, doc in mount_stats(self.mounts_dir).items():
            lv = [mount, image_of(doc)]
            fuse = doc.get("fuse") or {}
            bounds = [float(b) for b in fuse.get("latency_buckets", [])]
            for op, st in sorted((fuse.get("ops") or {}).items()):
                ops.add_metric([*lv, op], _num(st.get("count")))
                op_errors.add_metric([*lv, op], _num(st.get("errors")))
                counts = [int(_num(c)) for c in st.get("buckets", [])]
                if len(counts) == len(bounds) + 1:
                    cumulative: list[tuple[str, float]] = []
                    total = 0
                    for bound, n in zip([*(repr(b) for b in bounds), "+Inf"], counts, strict=True):
                        total += n
                        cumulative.append((bound, float(total)))
                    op_seconds.add_metric([*lv, op], cumulative, _num(st.get("seconds")))
            served.add_metric(lv, _num(fuse.get("read_bytes")))
            read_errors.add_metric(lv, _num(fuse.get("read_errors")) + _num(fuse.get("read_timeouts")))
            per_cause: dict[tuple[str, str], float] = {}
            h = m = 0.0
            for layer in doc.get("layers", []):
                registry = str(layer.get("registry", ""))
                causes = layer.get("fetched_bytes_by_cause") or {}
                for cause in {*FETCH_CAUSES, *causes}:
                    per_cause[(registry, cause)] = per_cause.get((registry, cause), 0.0) + _num(causes.get(cause))
                h += _num(layer.get("cache_hits"))
                m += _num(layer.get("cache_misses"))
            for (registry, cause), nbytes in sorted(per_cause.items()):
                fetched.add_metric([*lv, registry, cause], nbytes)
            hits.add_metric(lv, h)
            misses.add_metric(lv, m)
            reg = doc.get("registry") or {}
            for host, n in sorted((reg.get("bytes_by_host") or {}).items()):
                by_host.add_metric([*lv, host], _num(n))
            requests.add_metric(lv, _num(reg.get("requests")))
            cache = doc.get("cache") or {}
            evictions.add_metric(lv, _num(cache.get("evicted_chunks")))
            evicted_bytes.add_metric(lv, _num(cache.get("evicted_bytes")))
            direct = doc.get("direct")
            if isinstance(direct, dict):
                direct_files.add_metric(lv, _num(direct.get("files")))
                direct_bytes.add_metric(lv, _num(direct.get("bytes")))
        yield from (ops, op_errors, op_seconds, served, read_errors, fetched, by_host, requests, hits, misses,
                    evictions, evicted_bytes, direct_files, direct_bytes)
        if self.cache_usage is not None:
            try:
                used, chunks = self.cache_usage()
            except Exception as exc:  # a scrape must not fail because the cache is busy or broken
                log.warning("event=cache_usage_failed error=%s", exc)
            else:
                yield GaugeMetricFamily("snapshotter_cache_bytes", "bytes in the on-disk chunk cache", value=used)
                yield GaugeMetricFamily("snapshotter_cache_chunks", "chunks in the on-disk chunk cache",
                                        value=chunks)
