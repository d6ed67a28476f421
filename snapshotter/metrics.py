"""Prometheus metrics of the daemon (served on `metrics_address` when set).

Names and labels are documented in docs/metrics.md; where stargz-snapshotter has an equivalent
metric the docs say which. The mount processes' metrics (FUSE operations, bytes fetched, cache)
come from their stats files through remote.mountstats.MountStatsCollector, registered by the
daemon.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

GRPC_CALLS = Counter("snapshotter_grpc_calls_total", "gRPC calls by method and status code",
                     ["method", "code"], registry=REGISTRY)
GRPC_SECONDS = Histogram("snapshotter_grpc_seconds", "gRPC call latency by method", ["method"],
                         registry=REGISTRY)
LAYER_PREPARES = Counter("snapshotter_layer_prepares_total",
                         "layers prepared, by outcome (lazy, fallback) and format", ["outcome", "format"],
                         registry=REGISTRY)
FALLBACKS = Counter("snapshotter_fallbacks_total", "layers that fell back to a full pull, by reason",
                    ["reason"], registry=REGISTRY)
RESOLVE_SECONDS = Histogram("snapshotter_resolve_seconds", "time to resolve a lazy layer (footer + TOC)",
                            registry=REGISTRY, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
MOUNTS_ALIVE = Gauge("snapshotter_mounts_alive", "image mount processes alive", registry=REGISTRY)
GRPC_ERRORS = Counter("snapshotter_grpc_errors_total", "gRPC calls answered with a code other than OK, by method",
                      ["method"], registry=REGISTRY)
RESOLVE_BYTES = Counter("snapshotter_resolve_fetched_bytes_total",
                        "bytes the daemon fetched from registries to resolve lazy layers (footers, TOCs, "
                        "bootstraps), by registry", ["registry"], registry=REGISTRY)


def observe_grpc(method: str, code: str, seconds: float) -> None:
    GRPC_CALLS.labels(method, code).inc()
    GRPC_SECONDS.labels(method).observe(seconds)
    if code != "OK":
        GRPC_ERRORS.labels(method).inc()
