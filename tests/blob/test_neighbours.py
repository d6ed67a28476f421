"""BlobOrder: which chunks follow a chunk in its blob (read amplification's candidates)."""

from __future__ import annotations

from snapshotter.formats.index import Chunk, Compression, Entry, EntryType
from snapshotter.reader import BlobOrder


def chunk(offset: int, size: int, *, blob: int = 0, inner: int = 0, zeros: bool = False) -> Chunk:
    return Chunk(file_offset=0, size=size * 3, blob_offset=offset, blob_size=size, compression=Compression.GZIP,
                 digest=None, inner_offset=inner, blob_index=blob, zeros=zeros)


def reg(name: str, *chunks: Chunk) -> Entry:
    return Entry(name=name, type=EntryType.REG, size=sum(c.size for c in chunks), chunks=chunks)


def offsets(chunks: list[Chunk]) -> list[tuple[int, int, int]]:
    return [(c.blob_index, c.blob_offset, c.inner_offset) for c in chunks]


def test_follows_in_blob_order_not_entry_order() -> None:
    a, b, c, d = chunk(0, 100), chunk(150, 100), chunk(300, 100), chunk(450, 100)
    order = BlobOrder([reg("z", d), reg("y", b), reg("x", a, c), Entry(name="dir", type=EntryType.DIR)])
    assert offsets(order.following(a, max_bytes=10_000, max_gap=50)) == [(0, 150, 0), (0, 300, 0), (0, 450, 0)]
    assert offsets(order.following(c, max_bytes=10_000, max_gap=50)) == [(0, 450, 0)]
    assert order.following(d, max_bytes=10_000, max_gap=50) == []


def test_stops_at_a_gap_the_byte_window_and_the_blob_boundary() -> None:
    a, b, far = chunk(0, 100), chunk(110, 100), chunk(1000, 100)
    other_blob = chunk(220, 100, blob=1)
    order = BlobOrder([reg("f", a, b, far), reg("g", other_blob)])
    # 790 bytes of gap before `far`: beyond max_gap.
    assert offsets(order.following(a, max_bytes=10_000, max_gap=500)) == [(0, 110, 0)]
    assert offsets(order.following(a, max_bytes=10_000, max_gap=1000)) == [(0, 110, 0), (0, 1000, 0)]
    # The window counts from the end of `a` (100) to the end of each chunk: b ends at 210.
    assert order.following(a, max_bytes=109, max_gap=1000) == []
    assert offsets(order.following(a, max_bytes=110, max_gap=1000)) == [(0, 110, 0)]
    assert order.following(a, max_bytes=0, max_gap=1000) == []
    # Blob 1's chunk never follows a chunk of blob 0, whatever its offset.
    assert all(c.blob_index == 0 for c in order.following(a, max_bytes=1 << 20, max_gap=1 << 20))


def test_member_siblings_come_free_duplicates_and_zeros_do_not_count() -> None:
    # Two chunks in one compressed member (eStargz inner offsets), listed twice (a hard link's
    # copy of the entry), and an all-zero chunk that is never fetched.
    first, sibling = chunk(0, 200, inner=0), chunk(0, 200, inner=4096)
    zero, after = chunk(210, 10, zeros=True), chunk(230, 100)
    order = BlobOrder([reg("a", first, sibling), reg("a-link", first, sibling), reg("sparse", zero), reg("b", after)])
    assert offsets(order.following(first, max_bytes=1000, max_gap=100)) == [(0, 0, 4096), (0, 230, 0)]
    assert offsets(order.following(sibling, max_bytes=1000, max_gap=100)) == [(0, 0, 0), (0, 230, 0)]
