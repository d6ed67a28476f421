"""fusefs/direct.py without a kernel mount: which files are stored whole, when, and what the
direct directory holds. (The overlay reading a linked file from disk: tests/integration/test_lazy.py.)"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest
import trio

from snapshotter.cache import ChunkCache
from snapshotter.cache.keys import relative_path
from snapshotter.formats.index import LayerIndex
from snapshotter.fusefs.direct import DirectFiles
from snapshotter.fusefs.tree import MountTree, build_tree
from snapshotter.reader import FileRangeSource, LayerReader, ReaderConfig, cache_keys
from snapshotter.reader.keys import whole_file_key
from tests.blob.blobs import BuiltBlob, build_blob, file_bytes

CHUNK = 64 << 10
LAYER = "sha256:" + "2" * 64


@pytest.fixture
def blob(tmp_path: Path) -> BuiltBlob:
    rng = random.Random(5)
    files = {"big": file_bytes(rng, 5 * CHUNK + 321), "small": file_bytes(rng, 2 * CHUNK + 5),
             "one": file_bytes(rng, CHUNK - 1)}
    return build_blob(tmp_path / "layer.blob", files, chunk_size=CHUNK)


def _tree(blob: BuiltBlob) -> MountTree:
    return build_tree([[LayerIndex(format="test", entries=tuple(blob.entries.values()))]])


async def _run(tmp_path: Path, blob: BuiltBlob, reads: dict[str, tuple[int, int]], *,
               min_bytes: int = 3 * CHUNK, prepare: object = None) -> tuple[DirectFiles, ChunkCache]:
    """Serve `blob` through a LayerReader with a cache under tmp_path; read each named file's
    [offset, offset+size) and tell DirectFiles where a read reached the end, as ops.read does;
    return once its queue is worked off (bounded)."""
    tree = _tree(blob)
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    direct_dir = tmp_path / "direct"
    if callable(prepare):
        prepare(direct_dir)
    async with trio.open_nursery() as nursery:
        reader = LayerReader(FileRangeSource([blob.path]), blobs=[LAYER], cache=cache,
                             config=ReaderConfig(unit_bytes=0), nursery=nursery)
        direct = DirectFiles(tree, [reader], cache, direct_dir, min_bytes)
        nursery.start_soon(direct.run)
        for name, (off, size) in reads.items():
            node = tree.resolve("0/" + name)
            assert node is not None and node.entry is not None
            data = await reader.read(node.entry, off, size)
            assert bytes(data) == blob.contents[name][off:off + size]
            if off + len(data) == node.size:
                direct.note_end(node)
        with trio.fail_after(10):
            await direct.started.wait()
            while direct._queued:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return direct, cache


def test_a_big_file_read_to_its_end_is_stored_whole_pinned_and_linked(tmp_path: Path, blob: BuiltBlob) -> None:
    big = blob.contents["big"]
    direct, cache = trio.run(_run, tmp_path, blob, {"big": (0, len(big)), "small": (0, 2 * CHUNK + 5)})
    link = tmp_path / "direct" / "0" / "big"
    assert link.read_bytes() == big
    key = whole_file_key(blob.entries["big"], [LAYER])
    assert key is not None and cache.contains(key) and key in cache.pinned_keys()
    assert link.stat().st_ino == (tmp_path / "cache" / relative_path(key)).stat().st_ino
    assert not (tmp_path / "direct" / "0" / "small").exists(), "below min_bytes"
    assert direct.stats() == {"direct": {"files": 1, "bytes": len(big), "failed": 0}}


def test_nothing_is_stored_until_every_chunk_is_cached(tmp_path: Path, blob: BuiltBlob) -> None:
    size = len(blob.contents["big"])
    direct, cache = trio.run(_run, tmp_path, blob, {"big": (size - 100, 100)})  # the end, not the start
    key = whole_file_key(blob.entries["big"], [LAYER])
    assert key is not None and not cache.contains(key) and key not in cache.pinned_keys()
    assert not direct.linked and not (tmp_path / "direct" / "0").exists()


def test_start_empties_the_directory_and_links_files_cached_before(tmp_path: Path, blob: BuiltBlob) -> None:
    big = blob.contents["big"]
    trio.run(_run, tmp_path, blob, {"big": (0, len(big))})

    def stale(d: Path) -> None:  # what a dead mount process left, and a link of a file gone since
        (d / "0" / "gone").mkdir(parents=True)
        (d / "0" / "gone" / "file").write_bytes(b"old")
        (d / "junk").write_bytes(b"x")

    direct, _ = trio.run(lambda: _run(tmp_path, blob, {}, prepare=stale))
    assert direct.linked  # linked at start, with no read
    assert sorted(str(p.relative_to(tmp_path / "direct")) for p in (tmp_path / "direct").rglob("*")) == ["0", "0/big"]
    assert (tmp_path / "direct" / "0" / "big").read_bytes() == big


def test_one_chunk_files_are_left_to_fuse(tmp_path: Path, blob: BuiltBlob) -> None:
    direct, _ = trio.run(lambda: _run(tmp_path, blob, {"one": (0, CHUNK - 1)}, min_bytes=1))
    assert not direct.linked and whole_file_key(blob.entries["one"], [LAYER]) is None


def test_the_collection_keeps_the_whole_file_entry() -> None:
    """The daemon's garbage collection keeps what `cache_keys` lists: the whole-file key too."""
    rng = random.Random(1)
    built = build_blob(Path("/dev/null"), {"f": file_bytes(rng, 3 * CHUNK)}, chunk_size=CHUNK)
    entry = built.entries["f"]
    keys = set(cache_keys(entry, [LAYER]))
    whole = whole_file_key(entry, [LAYER])
    assert whole is not None and whole in keys and whole.startswith("file:")
    assert relative_path(whole).parts[:2] == ("chunks", "file")


def test_a_chunk_of_zeros_is_stored_as_zeros(tmp_path: Path, blob: BuiltBlob) -> None:
    """A zstd:chunked "zeros" chunk is never cached; the whole file holds its zeros."""
    entry = blob.entries["big"]
    chunks = list(entry.chunks)
    chunks[2] = dataclasses.replace(chunks[2], zeros=True, digest=None)
    blob.entries["big"] = dataclasses.replace(entry, chunks=tuple(chunks))
    c = chunks[2]
    old = blob.contents["big"]
    blob.contents["big"] = old[:c.file_offset] + bytes(c.size) + old[c.file_offset + c.size:]
    direct, _ = trio.run(_run, tmp_path, blob, {"big": (0, entry.size)})
    assert direct.linked
    assert (tmp_path / "direct" / "0" / "big").read_bytes() == blob.contents["big"]


def test_a_file_that_cannot_be_linked_stays_with_fuse_unpinned(tmp_path: Path, blob: BuiltBlob,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def cross_device(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    direct, cache = trio.run(_run, tmp_path, blob, {"big": (0, len(blob.contents["big"]))})
    key = whole_file_key(blob.entries["big"], [LAYER])
    assert not direct.linked and direct.stats()["direct"]["failed"] == 1
    assert key is not None and cache.contains(key) and key not in cache.pinned_keys()
