"""The warm cells' memory refill and memory control (integration/bench/freemem.py), on their own:
what they write, read and leave, how the balloon's feature is found, and how the report words it."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.bench.freemem import MemoryProbe, describe, free_page_reporting, probe_memory, refill_free_memory


def test_refill_reads_a_sparse_file_and_removes_it(tmp_path: Path) -> None:
    seconds = refill_free_memory(tmp_path, 8 << 20)
    assert seconds > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        refill_free_memory(tmp_path, 0)
    with pytest.raises(FileNotFoundError):
        refill_free_memory(tmp_path / "missing", 1 << 20)


def test_probe_reads_its_file_after_each_drop_and_refills_before_the_second(tmp_path: Path) -> None:
    events: list[tuple[str, int]] = []

    def drop() -> None:
        files = list(tmp_path.iterdir())
        assert len(files) == 1 and files[0].stat().st_size == 3 << 20  # written whole, no refill file left
        events.append(("drop", len(files)))

    dropped, refilled = probe_memory(tmp_path, 3 << 20, 0.0, 6 << 20, drop)
    assert events == [("drop", 1), ("drop", 1)]
    assert dropped > 0 and refilled > 0
    assert list(tmp_path.iterdir()) == []


def test_probe_removes_its_file_when_the_drop_fails(tmp_path: Path) -> None:
    def drop() -> None:
        raise PermissionError("not root")

    with pytest.raises(PermissionError):
        probe_memory(tmp_path, 1 << 20, 0.0, 2 << 20, drop)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        probe_memory(tmp_path, 0, 0.0, 2 << 20, drop)


def _device(root: Path, name: str, device: str, features: str) -> None:
    (root / name).mkdir()
    (root / name / "device").write_text(device + "\n")
    (root / name / "features").write_text(features + "\n")


def test_free_page_reporting_is_bit_5_of_a_balloon(tmp_path: Path) -> None:
    _device(tmp_path, "virtio1", "0x0002", "0010011")  # a block device with bit 5 set: not a balloon
    assert not free_page_reporting(tmp_path)
    _device(tmp_path, "virtio0", "0x0005", "0110000")  # a balloon with stats and deflate-on-oom only
    assert not free_page_reporting(tmp_path)
    (tmp_path / "virtio0" / "features").write_text("0110010100\n")  # as this lab's VM shows it
    assert free_page_reporting(tmp_path)
    assert not free_page_reporting(tmp_path / "none")


def test_description_gives_medians_and_ranges_of_both_reads() -> None:
    probes = [MemoryProbe("unshaped", 0, 256 << 20, 0.40, 0.07), MemoryProbe("unshaped", 1, 256 << 20, 0.10, 0.08),
              MemoryProbe("latency50", 0, 256 << 20, 0.30, 0.09)]
    text = describe(probes, 5.0, True)
    assert "a 256 MiB file read 5 s after the page cache was dropped 0.30 s (0.10–0.40)" in text
    assert "refill every measured warm run gets" in text and "0.08 s (0.07–0.09)" in text
    assert "3 probes" in text and "reports free pages to its host" in text
    assert "has no memory balloon that reports" in describe(probes, 5.0, False)
    with pytest.raises(ValueError):
        describe([], 5.0, True)
