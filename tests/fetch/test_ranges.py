import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.fetch.ranges import (
    ByteRange,
    RangeError,
    group_spans,
    multipart_boundary,
    parse_content_range,
    parse_multipart_byteranges,
    plan_spans,
    range_header,
)

ranges_st = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ranges=ranges_st, max_bytes=st.integers(1, 3000), max_gap=st.integers(0, 200))
def test_plan_spans_properties(ranges: list[tuple[int, int]], max_bytes: int, max_gap: int) -> None:
    spans = plan_spans(ranges, max_bytes=max_bytes, max_gap=max_gap)
    seen: list[int] = []
    for span in spans:
        assert span.range.length <= max(max_bytes, max(ranges[i][1] for i in span.members))
        for i in span.members:
            off, n = ranges[i]
            assert span.range.start <= off and off + n <= span.range.end
        # The span is exactly the hull of its members (no wasted bytes at the ends).
        assert span.range.start == min(ranges[i][0] for i in span.members)
        assert span.range.end == max(ranges[i][0] + ranges[i][1] for i in span.members)
        seen += span.members
    assert sorted(seen) == [i for i, (_, n) in enumerate(ranges) if n > 0]
    for a, b in zip(spans, spans[1:], strict=False):
        assert a.range.start <= b.range.start  # sorted
        # Greedy merging: the next span was not merged only because it was too far or too big.
        assert b.range.start - a.range.end > max_gap or max(a.range.end, b.range.end) - a.range.start > max_bytes


@settings(max_examples=200, deadline=None)
@given(ranges=ranges_st)
def test_adjacent_ranges_merge_without_waste(ranges: list[tuple[int, int]]) -> None:
    """With no gap allowed and an unbounded span size, fetched bytes == the union of the input."""
    spans = plan_spans(ranges, max_bytes=10**9, max_gap=0)
    union: set[int] = set()
    for off, n in ranges:
        union.update(range(off, off + n))
    assert sum(s.range.length for s in spans) == len(union)
    for a, b in zip(spans, spans[1:], strict=False):
        assert a.range.end < b.range.start  # touching spans would have merged


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), max_size=30), max_ranges=st.integers(1, 5),
       max_bytes=st.integers(1, 1500))
def test_group_spans(lengths: list[int], max_ranges: int, max_bytes: int) -> None:
    ranges, off = [], 0
    for n in lengths:
        ranges.append((off, n))
        off += n + 1
    spans = plan_spans(ranges, max_bytes=max_bytes)
    groups = group_spans(spans, max_ranges=max_ranges, max_bytes=max_bytes)
    assert [s for g in groups for s in g] == spans
    for g in groups:
        assert 1 <= len(g) <= max_ranges
        assert len(g) == 1 or sum(s.range.length for s in g) <= max_bytes


def test_plan_spans_examples() -> None:
    spans = plan_spans([(10, 5), (0, 10), (100, 1), (15, 0), (14, 3)], max_bytes=100)
    assert [(s.range.start, s.range.end, s.members) for s in spans] == [(0, 17, (1, 0, 4)), (100, 101, (2,))]
    assert [s.range for s in plan_spans([(0, 10), (12, 10)], max_bytes=100, max_gap=2)] == [ByteRange(0, 22)]
    assert len(plan_spans([(0, 10), (10, 10)], max_bytes=15)) == 2
    assert range_header([ByteRange(0, 10), ByteRange(20, 21)]) == "bytes=0-9,20-20"
    with pytest.raises(ValueError):
        plan_spans([(-1, 2)], max_bytes=10)


def test_content_range() -> None:
    assert parse_content_range("bytes 0-9/100") == (ByteRange(0, 10), 100)
    assert parse_content_range("bytes 5-5/*") == (ByteRange(5, 6), None)
    for bad in ("bytes 9-0/100", "bytes 0-100/100", "items 0-1/2", "bytes */100"):
        with pytest.raises(RangeError):
            parse_content_range(bad)


def test_multipart() -> None:
    body = (b"preamble\r\n--XYZ\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes 0-2/10\r\n\r\n"
            b"abc\r\n--XYZ\r\ncontent-range: bytes 7-9/10\r\n\r\nhij\r\n--XYZ--\r\n")
    assert multipart_boundary('multipart/byteranges; boundary="XYZ"') == "XYZ"
    assert multipart_boundary("multipart/byteranges; boundary=XYZ") == "XYZ"
    assert multipart_boundary("application/octet-stream") is None
    assert parse_multipart_byteranges(body, "XYZ") == [(ByteRange(0, 3), b"abc"), (ByteRange(7, 10), b"hij")]
    with pytest.raises(RangeError):
        parse_multipart_byteranges(body[:60], "XYZ")
    with pytest.raises(RangeError):
        parse_multipart_byteranges(b"--XYZ\r\nX: y\r\n\r\nabc\r\n--XYZ--", "XYZ")
