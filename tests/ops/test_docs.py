"""The operations docs cannot drift from the code: the configuration reference is the generated
one, docs/metrics.md lists exactly the metrics exposed, and relative links resolve."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from snapshotter import metrics
from snapshotter.fusefs.ops import LATENCY_BUCKETS
from snapshotter.remote.mountstats import MountStatsCollector
from snapshotter.tools import configdoc

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_configuration_reference_is_generated_from_config_py() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert configdoc.generated_part(text) == configdoc.render(), (
        "docs/configuration.md is stale: run `.venv/bin/python -m snapshotter.tools.configdoc --write`")
    from snapshotter.config import schema_keys

    for key, doc in schema_keys().items():
        assert f"`{key}`" in text and doc in text


def _stats_doc() -> dict[str, object]:
    op = {"count": 3, "errors": 1, "seconds": 0.01, "buckets": [1] * 3 + [0] * (len(LATENCY_BUCKETS) - 2)}
    return {
        "version": 1, "pid": 1, "started": 0, "time": 0, "mountpoint": "/m",
        "fuse": {"reads": 3, "read_bytes": 100, "read_errors": 0, "read_timeouts": 0, "unexpected_errors": 0,
                 "latency_buckets": list(LATENCY_BUCKETS), "ops": {"read": op}},
        "layers": [{"digest": "sha256:" + "a" * 64, "image": "r.example/x:1", "registry": "r.example",
                    "fetched_bytes": 10, "fetched_bytes_by_cause": {"on_demand": 10, "prefetch": 0, "background": 0},
                    "cache_hits": 1, "cache_misses": 1}],
        "registry": {"requests": 1, "retries": 0, "bytes_received": 10, "bytes_by_host": {"r.example": 10}},
        "cache": {"evicted_chunks": 0, "evicted_bytes": 0},
        "direct": {"files": 2, "bytes": 7 << 20, "failed": 0},
    }


def exposed_metric_names(tmp_path: Path) -> set[str]:
    """Every metric the daemon can expose, as scraped (counters with `_total`)."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stats.json").write_text(json.dumps(_stats_doc()))
    registry = CollectorRegistry()
    registry.register(MountStatsCollector(tmp_path, lambda: (5, 1)))
    names: set[str] = set()
    for text in (generate_latest(metrics.REGISTRY).decode(), generate_latest(registry).decode()):
        for family in text_string_to_metric_families(text):
            if not family.name.endswith("_created"):  # prometheus_client's creation-time series
                names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_metrics_doc_lists_exactly_the_exposed_metrics(tmp_path: Path) -> None:
    text = (DOCS / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(snapshotter_[a-z_]+)` \|", text, re.M))
    exposed = exposed_metric_names(tmp_path)
    assert documented == exposed, f"undocumented: {exposed - documented}; not exposed: {documented - exposed}"


def test_mount_collector_histogram_is_cumulative(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stats.json").write_text(json.dumps(_stats_doc()))
    registry = CollectorRegistry()
    registry.register(MountStatsCollector(tmp_path))
    samples = {(s.name, s.labels.get("le", s.labels.get("cause", ""))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("snapshotter_fuse_operation_seconds_bucket", "+Inf")] == 3
    assert samples[("snapshotter_fuse_operation_seconds_count", "")] == 3
    assert samples[("snapshotter_fuse_operation_seconds_bucket", repr(LATENCY_BUCKETS[0]))] == 1
    assert samples[("snapshotter_fetched_bytes_total", "on_demand")] == 10
    assert samples[("snapshotter_fetched_bytes_total", "prefetch")] == 0
    assert samples[("snapshotter_direct_files", "")] == 2 and samples[("snapshotter_direct_bytes", "")] == 7 << 20


def test_relative_links_in_docs_resolve() -> None:
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
