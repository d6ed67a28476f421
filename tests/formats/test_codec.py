"""codec.decompress_prefix: exactly the first `want` bytes of a (multi-member) stream."""

from __future__ import annotations

import gzip
import random

import pytest

from snapshotter.errors import FormatError
from snapshotter.formats.codec import decompress_prefix
from snapshotter.formats.index import Compression

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
