"""Persisted layer indexes load back equal, and garbage is a FormatError."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapshotter.errors import FormatError
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType, Landmark, LayerIndex
from snapshotter.formats.index_codec import MAGIC, dump_index, dump_index_json, load_index

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


def test_writes_version_2_and_still_reads_version_1() -> None:
    """Indexes persisted by an earlier release (JSON) load as before."""
    assert dump_index(INDEX).startswith(MAGIC)
    legacy = dump_index_json(INDEX)
    assert legacy.startswith(b"{")
    assert load_index(legacy) == INDEX


def test_version_2_refuses_code(tmp_path: Path) -> None:
    """A pickle that names a callable is refused before anything runs."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(FormatError, match="only plain data"):
        load_index(MAGIC + pickle.dumps(Evil(), protocol=5))
    assert not marker.exists()


@pytest.mark.parametrize("body", [
    (), ("estargz",), ("estargz", (), "none", (), None, [()]),
    ("estargz", (), "none", (), None, (("f", "reg"),)),
    ("estargz", (), "bogus", (), None, ()),
    ("estargz", (), "none", (), None, (("f", "reg", 0o644, 0, 0, 0, 5, "", 0, 0, (), 1, None, ()),)),  # no chunks
    ("estargz", (), "none", (), None, (("f", "reg", -1, 0, 0, 0, 0, "", 0, 0, (), 1, None, ()),)),
    ("estargz", (), "none", (), None, (("f", "reg", 0o644, 0, 0, 0, 4, "", 0, 0, (), 1, None,
                                        ((0, 4, 0, 9, "brotli", None, 0, 0, False),)),)),
    ("estargz", (), "none", (), None, (("f", "dir", 0o755, 0, 0, 0, 0, "", 0, 0, (("user.x", "str"),), 1, None,
                                        ()),)),
])
def test_version_2_structural_damage_is_format_error(body: object) -> None:
    with pytest.raises(FormatError):
        load_index(MAGIC + pickle.dumps(body, protocol=5))


@given(st.binary(max_size=300))
def test_version_2_never_crashes(tail: bytes) -> None:
    for data in (MAGIC + tail, dump_index(INDEX)[:len(MAGIC) + len(tail)]):
        try:
            load_index(data)
        except FormatError:
            pass
