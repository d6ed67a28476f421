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


def _v2(*objects: object) -> bytes:
    return MAGIC + b"".join(pickle.dumps(o, protocol=5) for o in objects)


_HEADER = ("estargz", (), "none", (), None, 1)
_FILE = ("f", "reg", 0o644, 0, 0, 0, 4, "", 0, 0, (), 1, None, ((0, 4, 0, 9, "gzip", None, 0, 0, False),))


def test_version_2_layout_as_documented() -> None:
    """Header, then batches of rows: a hand-built stream loads."""
    index = load_index(_v2(_HEADER, (_FILE,)))
    assert [e.name for e in index.entries] == ["f"] and index.entries[0].chunks[0].blob_size == 9


@pytest.mark.parametrize("objects", [
    (), ((),), (("estargz",),), (_HEADER,), (_HEADER, ()), (_HEADER, [_FILE]), (_HEADER, (_FILE, _FILE)),
    (_HEADER, (_FILE,), (_FILE,)), (_HEADER, (_FILE,), "trailing"),
    (("estargz", (), "bogus", (), None, 0),), (("estargz", (), "none", (), None, -1),),
    (_HEADER, (("f", "reg"),)),
    (_HEADER, (("f", "reg", 0o644, 0, 0, 0, 5, "", 0, 0, (), 1, None, ()),)),  # no chunks for 5 bytes
    (_HEADER, (("f", "reg", -1, 0, 0, 0, 0, "", 0, 0, (), 1, None, ()),)),
    (_HEADER, (("f", "reg", 0o644, 0, 0, 0, 4, "", 0, 0, (), 1, None, ((0, 4, 0, 9, "brotli", None, 0, 0, False),)),)),
    (_HEADER, (("f", "dir", 0o755, 0, 0, 0, 0, "", 0, 0, (("user.x", "str"),), 1, None, ()),)),
])
def test_version_2_structural_damage_is_format_error(objects: tuple[object, ...]) -> None:
    with pytest.raises(FormatError):
        load_index(_v2(*objects))


@given(st.binary(max_size=300))
def test_version_2_never_crashes(tail: bytes) -> None:
    for data in (MAGIC + tail, dump_index(INDEX)[:len(MAGIC) + len(tail)]):
        try:
            load_index(data)
        except FormatError:
            pass


def test_version_2_round_trips_many_batches() -> None:
    entries = tuple(Entry(f"d/f{i}", EntryType.REG, size=1, chunks=(Chunk(0, 1, 10 + i, 5, Compression.GZIP, None),))
                    for i in range(2500))
    index = LayerIndex(format="estargz", entries=(Entry("d", EntryType.DIR, 0o755), *entries))
    again = load_index(dump_index(index))
    assert again == index and again.entries == index.entries
