"""LayerReader over a real eStargz blob (our writer + TOC parser) of the formats corpus."""

from __future__ import annotations

import hashlib
import random
import tarfile
from pathlib import Path

import trio

from snapshotter.cache import ChunkCache
from snapshotter.formats.index import EntryType, normalize_name
from snapshotter.reader import FileRangeSource, ReaderConfig, open_layer_reader
from tests.formats.corpus import tar_tree, write_corpus_tar
from tests.formats.test_estargz import open_blob, write_blob


def test_every_file_of_an_estargz_layer_reads_back(tmp_path: Path) -> None:
    tar = write_corpus_tar(tmp_path / "layer.tar", big_size=1 << 20)
    blob = tmp_path / "layer.estargz"
    result = write_blob(tar, blob, chunk_size=64 << 10)
    _footer, index = open_blob(blob, result.digest)
    assert any(len(e.chunks) > 4 for e in index.regular_files())  # the big file spans chunks
    want = tar_tree(tar)
    contents: dict[str, bytes] = {}
    with tarfile.open(tar) as tf:
        for m in tf:
            f = tf.extractfile(m) if m.isreg() else None
            if f is not None:
                contents[normalize_name(m.name)] = f.read()
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    rng = random.Random(2)

    async def main() -> dict[str, bytes]:
        got: dict[str, bytes] = {}
        config = ReaderConfig(readahead_bytes=256 << 10)
        async with open_layer_reader(FileRangeSource([blob]), blobs=index.blobs or [result.digest],
                                     cache=cache, config=config) as reader:
            for e in index.regular_files():
                parts = [await reader.read(e, o, 50_000) for o in range(0, e.size, 50_000)]
                got[e.name] = b"".join(parts)
            big = max(index.regular_files(), key=lambda e: e.size)
            for _ in range(50):
                o, n = rng.randrange(big.size), rng.randrange(1, 300_000)
                assert await reader.read(big, o, n) == contents[big.name][o:o + n]
        return got

    got = trio.run(main)
    for name, facts in want.items():
        if facts.type == "reg":
            assert hashlib.sha256(got[name]).hexdigest() == facts.sha256, name
    assert {e.name for e in index.entries if e.type is EntryType.REG} >= {
        n for n, f in want.items() if f.type == "reg"
    }
