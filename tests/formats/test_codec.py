"""codec: decompress_prefix (exactly the first `want` bytes of a multi-member stream), the
streaming ChunkDecoder, and digest.DigestCheck."""

from __future__ import annotations

import gzip
import hashlib
import random

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.errors import DigestMismatch, FormatError
from snapshotter.formats.codec import DEFAULT_PIECE, ChunkDecoder, StreamDecoder, decompress_chunk, decompress_prefix
from snapshotter.formats.digest import DigestCheck
from snapshotter.formats.index import Chunk, Compression
from snapshotter.formats.lz4block import compress_block

_PARTS = [random.Random(1).randbytes(1000), b"x" * 5000, random.Random(2).randbytes(300)]
_PLAIN = b"".join(_PARTS)
_STREAM = b"".join(gzip.compress(p, mtime=0) for p in _PARTS)


@pytest.mark.parametrize("want", [0, 1, 999, 1000, 1001, 6000, 6300, 7000])
def test_gzip_prefix_across_members_from_bytes_and_views(want: int) -> None:
    assert decompress_prefix(Compression.GZIP, _STREAM, want) == _PLAIN[:want]
    assert decompress_prefix(Compression.GZIP, memoryview(_STREAM)[:], want) == _PLAIN[:want]


def test_gzip_prefix_of_a_cut_stream_is_what_it_holds_and_corruption_is_an_error() -> None:
    got = decompress_prefix(Compression.GZIP, _STREAM[:-10], len(_PLAIN))
    assert _PLAIN.startswith(got) and len(got) < len(_PLAIN)
    with pytest.raises(FormatError):
        decompress_prefix(Compression.GZIP, gzip.compress(_PARTS[0])[:-20] + b"garbage" * 5, 5000)


# -- ChunkDecoder: the same bytes from pieces ------------------------------------------------

def _zstd_frames(parts: list[bytes]) -> bytes:
    import zstandard

    return b"".join(zstandard.ZstdCompressor().compress(p) for p in parts)


def _streamed(chunk: Chunk, data: bytes, cuts: list[int], max_piece: int) -> list[bytes]:
    out: list[bytes] = []
    decoder = ChunkDecoder(chunk, out.append, max_piece=max_piece)
    pos = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        decoder.feed(memoryview(data)[pos:cut])
        pos = max(pos, cut)
    decoder.finish()
    return out


@settings(max_examples=200, deadline=None)
@given(
    compression=st.sampled_from([Compression.GZIP, Compression.ZSTD, Compression.NONE, Compression.LZ4_BLOCK]),
    inner=st.integers(0, 6000),
    size=st.integers(1, 7000),
    cuts=st.lists(st.integers(0, 9000), max_size=12),
    max_piece=st.sampled_from([1, 1000, 4096, 1 << 20]),
)
def test_chunk_decoder_from_any_pieces_gives_the_chunk(compression: Compression, inner: int, size: int,
                                                       cuts: list[int], max_piece: int) -> None:
    """Any split of the compressed bytes gives exactly decompress_chunk's bytes, in pieces of at
    most max_piece; gzip and zstd streams of several members / frames included."""
    size = min(size, len(_PLAIN) - inner)
    if size <= 0:
        return
    if compression is Compression.GZIP:
        data = _STREAM
    elif compression is Compression.ZSTD:
        data = _zstd_frames(_PARTS)
    elif compression is Compression.LZ4_BLOCK:
        data = compress_block(_PLAIN)
    else:
        data = _PLAIN
    chunk = Chunk(0, size, 0, len(data), compression, None, inner_offset=inner)
    pieces = _streamed(chunk, data, [c % (len(data) + 1) for c in cuts], max_piece)
    assert b"".join(pieces) == _PLAIN[inner:inner + size] == decompress_chunk(chunk, data)
    assert all(0 < len(p) <= max_piece for p in pieces)


def test_chunk_decoder_zeros_short_and_corrupt() -> None:
    zeros = Chunk(0, 5000, 0, 10, Compression.ZSTD, None, zeros=True)
    assert b"".join(_streamed(zeros, b"not looked at", [3], 2048)) == bytes(5000)
    gz = Chunk(0, len(_PLAIN), 0, len(_STREAM), Compression.GZIP, None)
    with pytest.raises(FormatError, match="decompressed to"):
        _streamed(gz, _STREAM[:-400], [100, 2000], 1 << 20)  # the stream ends short
    with pytest.raises(FormatError, match="corrupt"):
        _streamed(gz, _STREAM[:50] + b"\xff" * 60 + _STREAM[110:], [70], 1 << 20)


def test_stream_decoder_stops_reading_at_want() -> None:
    """Bytes after the wanted prefix are not decoded: trailing garbage (the next tar header's
    member, padding) does not matter once the chunk's bytes are out."""
    out: list[bytes] = []
    d = StreamDecoder(Compression.GZIP, 1000, out.append)
    d.feed(_STREAM)
    d.feed(b"garbage that is not gzip")
    d.close()
    assert b"".join(out) == _PLAIN[:1000] and d.complete


def test_digest_check_of_pieces() -> None:
    data = _PLAIN
    good = DigestCheck("sha256:" + hashlib.sha256(data).hexdigest().upper(), "chunk x")
    for i in range(0, len(data), 777):
        good.update(memoryview(data)[i:i + 777])
    good.verify()
    bad = DigestCheck("sha256:" + hashlib.sha256(data).hexdigest(), "chunk y")
    bad.update(data[:-1])
    with pytest.raises(DigestMismatch, match="chunk y"):
        bad.verify()
    with pytest.raises(FormatError, match="unsupported digest"):
        DigestCheck("md5:00", "chunk z")


def test_zstd_output_is_handed_on_in_small_pieces_not_held_per_chunk() -> None:
    """A streaming decoder hands zstd output on as it comes (at most 128 KiB waiting), so a
    mount decoding several 1 MiB Nydus chunks at once does not hold a chunk of output for each."""
    import tracemalloc

    rng = random.Random(5)
    data = bytes(rng.choice(b"abcdefgh ") for _ in range(1 << 20))
    comp = zstandard.ZstdCompressor(level=3).compress(data)
    chunk = Chunk(0, len(data), 0, len(comp), Compression.ZSTD, None)
    got = hashlib.sha256()
    sizes: list[int] = []

    def emit(piece: bytes) -> None:
        sizes.append(len(piece))
        got.update(piece)

    pieces = [comp[i:i + (64 << 10)] for i in range(0, len(comp), 64 << 10)]
    tracemalloc.start()
    try:
        decoder = ChunkDecoder(chunk, emit)
        for piece in pieces:
            decoder.feed(piece)
        decoder.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.hexdigest() == hashlib.sha256(data).hexdigest()
    assert len(sizes) > 4 and max(sizes) <= DEFAULT_PIECE, sizes
    assert peak < 768 << 10, f"peak {peak} bytes while decoding a 1 MiB chunk"


def test_gzip_inflater_matches_the_stdlib_and_checks_the_crc() -> None:
    """formats/inflate.py replaces the stdlib's inflate: same bytes out of multi-member streams,
    capped output resumes from the input the decompressor holds, and a member whose CRC-32
    trailer is wrong is an error (the TOC parse relies on it)."""
    from snapshotter.formats.inflate import InflateError, gzip_inflater

    member = gzip.compress(_PLAIN)
    d = gzip_inflater()
    assert d.decompress(member + b"next member") == _PLAIN and d.eof and d.unused_data == b"next member"
    # Output capped at max_length: the decompressor keeps the input it has not used yet and
    # says so (needs_input False); b"" takes the rest out (the contract codec.py relies on).
    d = gzip_inflater()
    first = d.decompress(member, 1000)
    assert len(first) == 1000 and not d.needs_input and not d.eof
    rest = d.decompress(b"", len(_PLAIN))
    assert first + rest == _PLAIN and d.eof
    with pytest.raises(EOFError):
        d.decompress(b"more")
    bad = bytearray(member)
    bad[-8] ^= 0xFF  # the trailer's CRC-32
    with pytest.raises(InflateError):
        gzip_inflater().decompress(bytes(bad))
