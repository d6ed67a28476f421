"""The mount process's stats file: written periodically and once more when the writer stops."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import trio

from snapshotter.fusefs.ops import FsStatistics
from snapshotter.fusefs.process import LayerSpec
from snapshotter.fusefs.stats import STATS_HOOKS, run_stats_writer
from snapshotter.reader.layer import ReaderStatistics


def test_writer_writes_periodically_and_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    spec = LayerSpec(index_path="/x", digest="sha256:" + "b" * 64,
                     reader={"kind": "registry", "image_ref": "reg.example:5000/app:1", "format": "estargz",
                             "blob_size": 99})
    state = SimpleNamespace(doc={"stats_file": str(path)}, mountpoint="/mnt", runs=((spec,),))
    ops = SimpleNamespace(stats=FsStatistics())
    reader = SimpleNamespace(stats=ReaderStatistics())
    env = SimpleNamespace(shared={STATS_HOOKS: [lambda: {"prefetch": {"state": "done"}}]})
    seen: list[dict[str, object]] = []

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_stats_writer, state, ops, [reader], env, 0.05)  # type: ignore[arg-type]
            await trio.sleep(0.2)
            seen.append(json.loads(path.read_text()))
            ops.stats.observe("read", 0.002, False)
            ops.stats.read_bytes += 4096
            reader.stats.fetched_bytes_by_cause["on_demand"] += 1000
            nursery.cancel_scope.cancel()  # the mount process stopping

    trio.run(scenario)
    final = json.loads(path.read_text())
    assert seen[0]["fuse"]["ops"] == {}  # type: ignore[index]
    assert final["fuse"]["read_bytes"] == 4096 and final["fuse"]["ops"]["read"]["count"] == 1
    assert sum(final["fuse"]["ops"]["read"]["buckets"]) == 1
    (layer,) = final["layers"]
    assert layer["registry"] == "reg.example:5000" and layer["image"] == "reg.example:5000/app:1"
    assert layer["fetched_bytes_by_cause"] == {"on_demand": 1000, "prefetch": 0, "background": 0}
    assert final["prefetch"] == {"state": "done"}
    assert not list(tmp_path.glob("*.tmp-*")), "no temp files left behind"


def test_no_stats_file_named_means_no_writer(tmp_path: Path) -> None:
    state = SimpleNamespace(doc={}, mountpoint="/mnt", runs=())

    async def scenario() -> None:
        with trio.move_on_after(1):
            await run_stats_writer(state, SimpleNamespace(stats=FsStatistics()), [],  # type: ignore[arg-type]
                                   SimpleNamespace(shared={}))

    trio.run(scenario)
    assert list(tmp_path.iterdir()) == []
