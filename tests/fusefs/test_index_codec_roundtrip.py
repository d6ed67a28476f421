"""index_codec round trips arbitrary indexes (the mount process relies on it for every layer)."""

from __future__ import annotations

from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.formats.index import Chunk, Compression, Entry, EntryType, Landmark, LayerIndex
from snapshotter.formats.index_codec import dump_index, load_index

names = st.text(st.characters(exclude_characters="\x00/", exclude_categories=["Cs"]), min_size=1, max_size=8)
odd_names = st.one_of(names, st.sampled_from(["caf\udce9", "sp ace", "\\u0000", '"q"']))  # surrogate-escaped too
digests = st.one_of(st.none(), st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: "sha256:" + h))


@st.composite
def entries(draw: st.DrawFn) -> Entry:
    etype = draw(st.sampled_from(list(EntryType)))
    name = "/".join(draw(st.lists(odd_names, min_size=1, max_size=3)))
    chunks: tuple[Chunk, ...] = ()
    size = 0
    if etype is EntryType.REG:
        sizes = draw(st.lists(st.integers(1, 1 << 40), max_size=4))
        off = 0
        out = []
        for s in sizes:
            out.append(Chunk(off, s, draw(st.integers(0, 1 << 50)), draw(st.integers(0, 1 << 30)),
                             draw(st.sampled_from(list(Compression))), draw(digests),
                             inner_offset=draw(st.integers(0, 1 << 20)), blob_index=draw(st.integers(0, 3)),
                             zeros=draw(st.booleans())))
            off += s
        chunks, size = tuple(out), off
    xattrs = draw(st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: "\x00" not in k),
                                  st.binary(max_size=20), max_size=3))
    return Entry(
        name=name, type=etype, mode=draw(st.integers(0, 0o7777)), uid=draw(st.integers(0, 1 << 32)),
        gid=draw(st.integers(0, 1 << 32)), mtime_ns=draw(st.integers(-(1 << 62), 1 << 62)), size=size,
        link_target=draw(st.one_of(st.just(""), names)), dev_major=draw(st.integers(0, 4095)),
        dev_minor=draw(st.integers(0, 1 << 20)), xattrs=MappingProxyType(xattrs), nlink=draw(st.integers(1, 9)),
        digest=draw(digests), chunks=chunks,
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(entries(), max_size=6), st.sampled_from(list(Landmark)), st.lists(names, max_size=3), digests)
def test_round_trip(es: list[Entry], landmark: Landmark, prefetch: list[str], toc: str | None) -> None:
    index = LayerIndex(format="estargz", entries=tuple(es), blobs=("sha256:" + "1" * 64,), landmark=landmark,
                       prefetch=tuple(prefetch), toc_digest=toc)
    data = dump_index(index)
    again = load_index(data)
    assert again == index
    assert [dict(e.xattrs) for e in again.entries] == [dict(e.xattrs) for e in index.entries]
    assert dump_index(again) == data
