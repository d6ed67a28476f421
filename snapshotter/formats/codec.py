"""Decompress one chunk's blob bytes into the file bytes it holds. Pure, bounded.

`decompress_chunk(chunk, data)` takes the compressed bytes `data` = blob[chunk.blob_offset :
chunk.blob_offset + chunk.blob_size] and returns exactly `chunk.size` bytes: the uncompressed
stream from `chunk.inner_offset` on. It never produces more than inner_offset + size bytes of
output (a hostile member cannot blow up memory) and raises FormatError when the data is not
valid or too short.
"""

from __future__ import annotations

import zlib

import zstandard

from snapshotter.errors import FormatError
from snapshotter.formats.index import Chunk, Compression

_BLOCK = 1 << 16
# What the decoders read: a fetch's buffer or a view into it (no copy per chunk of a merged run).
Buffer = bytes | bytearray | memoryview


def _gunzip_prefix(data: Buffer, want: int) -> bytes:
    """The first `want` bytes of a gzip stream (which may span several members)."""
    if want <= 0:
        return b""  # (zlib reads a max_length of 0 as "no limit")
    d = zlib.decompressobj(wbits=31)
    try:
        plain = d.decompress(data, want)
        if len(plain) >= want or not d.eof or not d.unused_data:
            # One member held it all (a chunk's usual case), or the stream ends short: either
            # way this is the answer, with no copy of it.
            return plain
        out = bytearray(plain)
        pending = d.unused_data
        while len(out) < want and pending:  # the members after the first
            d = zlib.decompressobj(wbits=31)
            out += d.decompress(pending, want - len(out))
            if not d.eof:
                break  # cut short, or `want` reached inside this member
            pending = d.unused_data
    except zlib.error as exc:
        raise FormatError(f"gzip data is corrupt: {exc}") from None
    return bytes(out)


def _unzstd_prefix(data: Buffer, want: int) -> bytes:
    """The first `want` bytes of a zstd stream (frames concatenated; skippable frames allowed)."""
    out = bytearray()
    pending = data
    try:
        while len(out) < want and pending:
            d = zstandard.ZstdDecompressor().decompressobj()
            view = memoryview(pending)
            pos = 0
            while len(out) < want and pos < len(view) and not d.eof:
                # Feed small slices so output stays bounded by roughly want + one block.
                out += d.decompress(view[pos:pos + _BLOCK].tobytes())
                pos += _BLOCK
            if not d.eof:
                break
            pending = d.unused_data + view[pos:].tobytes()
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd data is corrupt: {exc}") from None
    return bytes(out[:want])


def decompress_prefix(compression: Compression, data: Buffer, want: int) -> bytes:
    """Up to `want` bytes of the uncompressed stream that `data` starts."""
    if compression is Compression.NONE:
        return bytes(memoryview(data)[:want])
    if compression is Compression.GZIP:
        return _gunzip_prefix(data, want)
    if compression is Compression.ZSTD:
        return _unzstd_prefix(data, want)
    if compression is Compression.LZ4_BLOCK:
        from snapshotter.formats.lz4block import decompress_block

        return decompress_block(bytes(data), max_output=want)[:want]
    raise FormatError(f"unsupported compression {compression}")


def decompress_chunk(chunk: Chunk, data: Buffer) -> bytes:
    """The chunk's `size` file bytes from its compressed blob range `data`.

    A `zeros` chunk is all zeros by definition; `data` is not looked at (it may be empty).
    """
    if chunk.zeros:
        return bytes(chunk.size)
    want = chunk.inner_offset + chunk.size
    plain = decompress_prefix(chunk.compression, data, want)
    if len(plain) < want:
        raise FormatError(
            f"chunk at blob offset {chunk.blob_offset} ({chunk.compression.value}) decompressed to "
            f"{len(plain)} bytes, expected at least {want}"
        )
    return plain if chunk.inner_offset == 0 and len(plain) == want else plain[chunk.inner_offset:want]
