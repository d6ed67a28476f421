"""Persisted layer indexes load back equal, and garbage is a FormatError."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapshotter.errors import FormatError
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType, Landmark, LayerIndex
from snapshotter.formats.index_codec import dump_index, load_index

INDEX = LayerIndex(
    format="estargz",
    entries=(
        Entry("", EntryType.DIR, 0o755),
        Entry("bin/sh", EntryType.SYMLINK, 0o777, link_target="busybox"),
        Entry("dev/null", EntryType.CHAR, 0o666, dev_major=1, dev_minor=3),
        Entry("f", EntryType.REG, 0o4755, uid=1, gid=2, mtime_ns=1_700_000_000_123, size=10, nlink=2,
              xattrs=MappingProxyType({"user.a": b"\x00\xff"}), digest="sha256:" + "a" * 64,
              chunks=(Chunk(0, 4, 100, 50, Compression.GZIP, "sha256:" + "b" * 64),
                      Chunk(4, 6, 150, 20, Compression.ZSTD, None, inner_offset=7, blob_index=1, zeros=True))),
        Entry("g", EntryType.HARDLINK, link_target="f"),
    ),
    blobs=("sha256:" + "c" * 64,), landmark=Landmark.PREFETCH, prefetch=("f",), toc_digest="sha256:" + "d" * 64,
)


def test_round_trip() -> None:
    again = load_index(dump_index(INDEX))
    assert again == INDEX
    assert again.entries == INDEX.entries and again["f"].chunks[1].zeros


@pytest.mark.parametrize("bad", [b"", b"{}", b"[1]", b'{"version": 2}', b'{"version": 1, "entries": [{}]}'])
def test_garbage_is_format_error(bad: bytes) -> None:
    with pytest.raises(FormatError):
        load_index(bad)


@given(st.binary(max_size=200))
def test_never_crashes(data: bytes) -> None:
    try:
        load_index(data)
    except FormatError:
        pass
