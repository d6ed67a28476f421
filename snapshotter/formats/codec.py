"""Decompress one chunk's blob bytes into the file bytes it holds. Pure, bounded.

`decompress_chunk(chunk, data)` takes the compressed bytes `data` = blob[chunk.blob_offset :
chunk.blob_offset + chunk.blob_size] and returns exactly `chunk.size` bytes: the uncompressed
stream from `chunk.inner_offset` on. It never produces more than inner_offset + size bytes of
output (a hostile member cannot blow up memory) and raises FormatError when the data is not
valid or too short.

`ChunkDecoder` does the same from compressed bytes that arrive in pieces (a range answer being
read), handing the file bytes out in pieces of at most `max_piece` bytes as they are decoded, so
that neither the compressed nor the uncompressed chunk is ever held whole (but for LZ4 blocks,
which only decode whole). `decompress_chunk` and `decompress_prefix` are the one-piece use of it.
"""

from __future__ import annotations

from collections.abc import Callable

import zstandard

from snapshotter.errors import FormatError
from snapshotter.formats.index import Chunk, Compression
from snapshotter.formats.inflate import InflateError, Inflater, gzip_inflater

_BLOCK = 1 << 16
# What the decoders read: a fetch's buffer or a view into it (no copy per chunk of a merged run).
Buffer = bytes | bytearray | memoryview
Emit = Callable[[bytes], None]
DEFAULT_PIECE = 1 << 20
# zstd output is handed on once this much of it is waiting (or max_piece, if smaller). Holding
# up to max_piece per decoder (a whole 1 MiB Nydus chunk) raised a process's peak by 4-5 MiB
# with six chunks decoding at once; handed on at 128 KiB, by nothing measurable.
_ZSTD_FLUSH = 128 << 10


class StreamDecoder:
    """The first `want` bytes of the uncompressed stream that the fed bytes start, given to
    `emit` in pieces of at most `max_piece` bytes (each piece a bytes object of its own).

    gzip and zstd streams may span several members / frames (zstd skippable frames allowed);
    input after the `want`-th output byte is not looked at. `produced` counts what was emitted.
    Corrupt input raises FormatError; a stream that ends short is not an error here (see
    `ChunkDecoder.finish`).
    """

    def __init__(self, compression: Compression, want: int, emit: Emit, *, max_piece: int = DEFAULT_PIECE) -> None:
        if compression not in (Compression.NONE, Compression.GZIP, Compression.ZSTD, Compression.LZ4_BLOCK):
            raise FormatError(f"unsupported compression {compression}")
        self.compression = compression
        self.want = want
        self.produced = 0
        self._emit = emit
        self._max_piece = max(1, max_piece)
        self._gzip: Inflater | None = None
        self._zstd: zstandard.ZstdDecompressionObj | None = None
        self._zstd_out = bytearray()
        self._lz4 = bytearray()

    @property
    def complete(self) -> bool:
        return self.produced >= self.want

    def feed(self, data: Buffer) -> None:
        if self.complete or not data:
            return
        if self.compression is Compression.GZIP:
            self._feed_gzip(data)
        elif self.compression is Compression.ZSTD:
            self._feed_zstd(data)
        elif self.compression is Compression.LZ4_BLOCK:
            self._lz4 += data
        else:
            self._give(bytes(memoryview(data)[:self.want - self.produced]))
        if self.complete:
            # The decompressor (its state and 32 KiB window) goes now, not with this object:
            # a run's decoders live until its last chunk is in.
            self._gzip = self._zstd = None

    def close(self) -> None:
        """No more input: decode what only decodes whole (an LZ4 block) and flush."""
        if self.compression is Compression.LZ4_BLOCK and not self.complete and self._lz4:
            from snapshotter.formats.lz4block import decompress_block

            block, self._lz4 = bytes(self._lz4), bytearray()
            self._give(decompress_block(block, max_output=self.want)[:self.want])
        if self._zstd_out:
            self._flush_zstd(final=True)

    def _give(self, piece: bytes) -> None:
        """Emit `piece` (already cut to `want`) in pieces of at most max_piece."""
        if len(piece) <= self._max_piece:
            if piece:
                self.produced += len(piece)
                self._emit(piece)
            return
        view = memoryview(piece)
        for i in range(0, len(piece), self._max_piece):
            part = bytes(view[i:i + self._max_piece])
            self.produced += len(part)
            self._emit(part)

    def _feed_gzip(self, data: Buffer) -> None:
        pending: Buffer = data
        try:
            while not self.complete:
                if self._gzip is None:
                    if not pending:
                        break
                    self._gzip = gzip_inflater()
                d = self._gzip
                out = d.decompress(pending, min(self.want - self.produced, self._max_piece))
                pending = b""  # the decompressor holds what it did not use yet
                if d.eof:
                    pending = d.unused_data  # the next member starts there
                    self._gzip = None
                if out:
                    self.produced += len(out)
                    self._emit(out)
                if not d.eof and (d.needs_input or not out):
                    break  # needs more input (or, on hostile input, made no progress)
        except InflateError as exc:
            raise FormatError(f"gzip data is corrupt: {exc}") from None

    def _feed_zstd(self, data: Buffer) -> None:
        view = memoryview(data)
        pos = 0
        try:
            while pos < len(view) and not self.complete:
                if self._zstd is None:
                    self._zstd = zstandard.ZstdDecompressor().decompressobj()
                d = self._zstd
                # Small slices keep the output of one call bounded by about a block.
                piece = view[pos:pos + _BLOCK].tobytes()
                pos += len(piece)
                self._zstd_out += d.decompress(piece)
                if d.eof:
                    self._zstd = None
                    rest = d.unused_data
                    if rest:  # the next frame started inside this slice: give it back
                        pos -= len(rest)
                self._flush_zstd(final=False)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd data is corrupt: {exc}") from None

    def _flush_zstd(self, *, final: bool) -> None:
        out = self._zstd_out
        limit = self.want - self.produced
        if len(out) >= limit:
            self._zstd_out = bytearray()
            self._give(bytes(out[:limit]))
        elif final or len(out) >= min(self._max_piece, _ZSTD_FLUSH):
            self._zstd_out = bytearray()
            self._give(bytes(out))


class ChunkDecoder:
    """Streaming `decompress_chunk`: feed `chunk`'s compressed bytes in order (in any pieces),
    then `finish()`; `emit` receives exactly the chunk's `size` file bytes in all (the stream
    after `inner_offset`), in pieces of at most `max_piece` bytes. A `zeros` chunk ignores its
    input and emits zeros. FormatError for corrupt data or, from `finish`, a short stream."""

    def __init__(self, chunk: Chunk, emit: Emit, *, max_piece: int = DEFAULT_PIECE) -> None:
        self.chunk = chunk
        self._emit = emit
        self._max_piece = max(1, max_piece)
        self._skip = chunk.inner_offset
        self._stream = None if chunk.zeros else StreamDecoder(
            chunk.compression, chunk.inner_offset + chunk.size, self._take, max_piece=max_piece)

    def _take(self, piece: bytes) -> None:
        if self._skip:
            n = min(self._skip, len(piece))
            self._skip -= n
            piece = piece[n:]
        if piece:
            self._emit(piece)

    def feed(self, data: Buffer) -> None:
        if self._stream is not None:
            self._stream.feed(data)

    def finish(self) -> None:
        chunk = self.chunk
        if self._stream is None:
            for i in range(0, chunk.size, self._max_piece):
                self._emit(bytes(min(self._max_piece, chunk.size - i)))
            return
        self._stream.close()
        if not self._stream.complete:
            raise FormatError(
                f"chunk at blob offset {chunk.blob_offset} ({chunk.compression.value}) decompressed to "
                f"{self._stream.produced} bytes, expected at least {self._stream.want}"
            )


def _one_piece(pieces: list[bytes]) -> bytes:
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def decompress_prefix(compression: Compression, data: Buffer, want: int) -> bytes:
    """Up to `want` bytes of the uncompressed stream that `data` starts."""
    pieces: list[bytes] = []
    if want > 0:
        decoder = StreamDecoder(compression, want, pieces.append, max_piece=want)
        decoder.feed(data)
        decoder.close()
    return _one_piece(pieces)


def decompress_chunk(chunk: Chunk, data: Buffer) -> bytes:
    """The chunk's `size` file bytes from its compressed blob range `data`.

    A `zeros` chunk is all zeros by definition; `data` is not looked at (it may be empty).
    A chunk of one gzip member with no inner offset decompresses straight to its bytes (no copy).
    """
    pieces: list[bytes] = []
    decoder = ChunkDecoder(chunk, pieces.append, max_piece=max(1, chunk.inner_offset + chunk.size))
    decoder.feed(data)
    decoder.finish()
    return _one_piece(pieces)
