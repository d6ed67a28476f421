"""The warm read's disk control (integration/bench/diskprobe.py), on its own: what it writes,
reads and leaves, and how the report words it."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.bench.diskprobe import DiskProbe, describe, probe_fresh_file


def test_probe_reads_a_fresh_file_twice_after_each_drop_and_removes_it(tmp_path: Path) -> None:
    events: list[str] = []

    def drop() -> None:
        files = [p for p in tmp_path.iterdir()]
        assert len(files) == 1 and files[0].stat().st_size == 3 << 20  # written whole before any read
        events.append("drop")

    first, second = probe_fresh_file(tmp_path, 3 << 20, 0.0, drop)
    assert events == ["drop", "drop"]
    assert first > 0 and second > 0
    assert list(tmp_path.iterdir()) == []


def test_probe_removes_its_file_when_the_drop_fails(tmp_path: Path) -> None:
    def drop() -> None:
        raise PermissionError("not root")

    with pytest.raises(PermissionError):
        probe_fresh_file(tmp_path, 1 << 20, 0.0, drop)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        probe_fresh_file(tmp_path, 0, 0.0, drop)


def test_description_gives_medians_and_ranges_of_both_reads() -> None:
    probes = [DiskProbe("unshaped", 0, 256 << 20, 0.40, 0.07), DiskProbe("unshaped", 1, 256 << 20, 0.10, 0.08),
              DiskProbe("latency50", 0, 256 << 20, 0.30, 0.09)]
    text = describe(probes, 5.0)
    assert "a new 256 MiB file of random bytes written, left 5 s" in text
    assert "(3 probes" in text
    assert "first read 0.30 s (0.10–0.40)" in text and "second read 0.08 s (0.07–0.09)" in text
    with pytest.raises(ValueError):
        describe([], 5.0)
