"""gzip inflate for the read paths (chunks, eStargz TOCs, Nydus bootstrap layers). Pure.

zlib-ng's inflate: on the bench image's 9.2 MB prefetch region (166 eStargz chunks, 22.7 MB of
file bytes) decoding into the cache took 105 ms instead of the stdlib's 153 ms, and a 0.58 MB TOC
member 5 ms instead of 12 ms. Writers keep the stdlib's deflate: their output bytes (and so layer
digests) stay what they were.

The binding's `_ZlibDecompressor` (the stdlib's own gzip reader uses the same type since 3.12),
not its copy of `decompressobj`: asked for at most N bytes, it allocates N at once and trims the
result, where `decompressobj` starts at 16 KiB and doubles by realloc up to N. In a mount process
(its malloc keeps buffers up to 2 MiB on the heap, memory.py) that chain of 16 KiB..1 MiB
reallocs per 1 MiB piece fragmented the heap: the mount process of a cold sha256 of the bench
image's 256 MiB file peaked at 83.5 MiB, 73.4 MiB with the stdlib's inflate, 72.4 MiB with this
type.

The decompressor's contract (see `gzip_inflater`): `decompress(data, max_length)` appends `data`
to what it holds and returns at most max_length bytes; `needs_input` is False when it holds input
that can give more output (call again with b""); at the member's end `eof` is True, the
decompressor's state is freed, and the input after the member is in `unused_data`. Calling it
after `eof` raises EOFError.
"""

from __future__ import annotations

from typing import cast

from zlib_ng import zlib_ng

Inflater = zlib_ng._ZlibDecompressor
# The binding's stub types `error` as an instance; it is the exception class its calls raise.
InflateError = cast(type[Exception], zlib_ng.error)


def gzip_inflater() -> Inflater:
    """A decompressor of one gzip member (header and trailer checked, CRC-32 included)."""
    return zlib_ng._ZlibDecompressor(wbits=31)
