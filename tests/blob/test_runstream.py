"""RunDecoder: a run's range answer decoded as it arrives, each chunk verified into the cache."""

from __future__ import annotations

import gzip
import hashlib
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.cache import ChunkCache
from snapshotter.errors import DigestMismatch
from snapshotter.formats.index import Chunk, Compression
from snapshotter.reader.runstream import CacheTarget, ChunkOutcome, MemoryTarget, RunDecoder
from tests.cache.helpers import temp_files

GAP = b"\x1f\x8b-not-a-member-"  # what lies between payloads (an eStargz tar header member, say)


def make_run(seed: int, n: int, start: int = 1000) -> tuple[bytes, list[tuple[str, Chunk]], list[bytes]]:
    """Blob bytes from `start` on holding n gzip chunks with gaps between them, and the chunks."""
    rng = random.Random(seed)
    plains = [rng.randbytes(rng.randrange(1, 40_000)) if i % 2 else b"text " * rng.randrange(1, 9000)
              for i in range(n)]
    blob, run, pos = bytearray(), [], start
    for i, plain in enumerate(plains):
        member = gzip.compress(plain, mtime=0)
        digest = "sha256:" + hashlib.sha256(plain).hexdigest()
        run.append((digest, Chunk(i * 1_000_000, len(plain), pos, len(member), Compression.GZIP, digest)))
        blob += member + GAP
        pos += len(member) + len(GAP)
    return bytes(blob), run, plains


def feed_in_pieces(decoder: RunDecoder, blob: bytes, cuts: list[int]) -> None:
    pos = 0
    for cut in sorted(set(c % (len(blob) + 1) for c in cuts)) + [len(blob)]:
        decoder.feed(memoryview(blob)[pos:cut])
        pos = max(pos, cut)
    decoder.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000), cuts=st.lists(st.integers(0, 1 << 20), max_size=20))
def test_any_split_stores_every_chunk_verified(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                               cuts: list[int]) -> None:
    tmp = tmp_path_factory.mktemp("cache")
    cache = ChunkCache(tmp, 1 << 30)
    blob, run, plains = make_run(seed, 6)
    ended: list[int] = []
    decoder = RunDecoder(run, 1000, lambda c, key: CacheTarget(cache, key, keep_open=False),
                         on_ended=lambda batch: ended.extend(i for i, _ in batch), max_piece=4096)
    feed_in_pieces(decoder, blob, cuts)
    assert ended == list(range(len(run)))  # each reported once, in run order
    assert all(o.stored and o.error is None for o in decoder.outcomes())
    for (key, _), plain in zip(run, plains, strict=True):
        assert cache.get(key) == plain
    assert temp_files(tmp) == []


def test_a_corrupt_chunk_fails_alone_and_leaves_no_file(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    blob, run, plains = make_run(3, 4)
    key1, c1 = run[1]
    bad = bytearray(blob)
    bad[c1.blob_offset - 1000 + c1.blob_size // 2] ^= 0xFF  # one flipped byte inside chunk 1
    decoder = RunDecoder(run, 1000, lambda c, key: CacheTarget(cache, key, keep_open=False))
    feed_in_pieces(decoder, bytes(bad), [5000, 30_000])
    outcomes = decoder.outcomes()
    assert isinstance(outcomes[1].error, DigestMismatch) and key1 in str(outcomes[1].error)
    assert [o.stored for o in outcomes] == [True, False, True, True]
    assert not cache.contains(key1) and temp_files(tmp_path) == []


def test_reset_starts_over_and_memory_targets_hold_the_bytes(tmp_path: Path) -> None:
    blob, run, plains = make_run(4, 3)
    ended: list[tuple[int, ChunkOutcome]] = []
    decoder = RunDecoder(run, 1000, lambda c, key: MemoryTarget(), on_ended=ended.extend)
    decoder.feed(blob[:len(blob) // 2])
    decoder.reset()  # a retried request: the answer comes again from its first byte
    feed_in_pieces(decoder, blob, [777, 12_345])
    assert [o.data for o in decoder.outcomes()] == plains
    assert [i for i, _ in ended][-3:] == [0, 1, 2]


def test_a_short_answer_fails_the_chunks_it_did_not_finish(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    blob, run, _ = make_run(5, 3)
    decoder = RunDecoder(run, 1000, lambda c, key: CacheTarget(cache, key, keep_open=False))
    feed_in_pieces(decoder, blob[:run[2][1].blob_offset - 1000 + 10], [])
    outcomes = decoder.outcomes()
    assert outcomes[0].stored and outcomes[1].stored
    assert outcomes[2].error is not None and not cache.contains(run[2][0])
    assert temp_files(tmp_path) == []


def test_the_chunks_one_piece_ends_are_reported_in_one_call_but_an_urgent_one_at_once(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 30)
    blob, run, _ = make_run(6, 5)
    calls: list[list[int]] = []
    decoder = RunDecoder(run, 1000, lambda c, key: CacheTarget(cache, key, keep_open=False),
                         on_ended=lambda batch: calls.append([i for i, _ in batch]))
    decoder.feed(blob)
    decoder.close()
    assert calls == [[0, 1, 2, 3, 4]]  # one hop to the reader's event loop for the whole piece

    calls.clear()
    urgent = {run[1][0]}  # a read waits for chunk 1
    decoder = RunDecoder(run, 1000, lambda c, key: MemoryTarget(), urgent=urgent,
                         on_ended=lambda batch: calls.append([i for i, _ in batch]))
    decoder.feed(blob)
    decoder.close()
    assert calls == [[0, 1], [2, 3, 4]]  # chunk 1 (and 0 before it) not held for the rest
    assert all(o.data is not None for o in decoder.outcomes())
