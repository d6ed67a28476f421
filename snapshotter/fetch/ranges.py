"""Pure byte-range logic of the Range fetcher: planning merged spans, parsing answers.

No IO. `plan_spans` is what `RegistryClient.read_ranges` uses to turn many small reads into
few requests; `parse_content_range` and `parse_multipart_byteranges` check what came back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


class RangeError(ValueError):
    """A server's range answer is malformed (the caller turns it into a FetchError)."""


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Half-open [start, end)."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    def header_spec(self) -> str:
        """The `a-b` form used in Range / Content-Range (inclusive end)."""
        return f"{self.start}-{self.end - 1}"

    def __str__(self) -> str:
        return f"bytes {self.header_spec()}"


@dataclass(frozen=True)
class Span:
    """One contiguous range to request, and the indexes of the input ranges it serves."""

    range: ByteRange
    members: tuple[int, ...]


def plan_spans(ranges: Sequence[tuple[int, int]], *, max_bytes: int, max_gap: int = 0) -> list[Span]:
    """Merge (offset, length) ranges into sorted, disjoint spans.

    Ranges that overlap or lie within `max_gap` bytes of each other are merged while the merged
    span stays <= max_bytes. A single range longer than max_bytes is its own span (never split:
    the caller wants it in one piece). Zero-length ranges join no span (members of none).
    Every non-empty input range lies wholly inside exactly one span.
    """
    if max_bytes < 1 or max_gap < 0:
        raise ValueError("max_bytes must be >= 1 and max_gap >= 0")
    order = sorted(
        (i for i, (off, n) in enumerate(ranges) if n > 0),
        key=lambda i: (ranges[i][0], ranges[i][0] + ranges[i][1]),
    )
    for off, n in ranges:
        if off < 0 or n < 0:
            raise ValueError(f"negative range {off}+{n}")
    spans: list[Span] = []
    cur_start = cur_end = 0
    members: list[int] = []
    for i in order:
        off, n = ranges[i]
        end = off + n
        if members and off - cur_end <= max_gap and max(end, cur_end) - cur_start <= max_bytes:
            cur_end = max(cur_end, end)
            members.append(i)
            continue
        if members:
            spans.append(Span(ByteRange(cur_start, cur_end), tuple(members)))
        cur_start, cur_end, members = off, end, [i]
    if members:
        spans.append(Span(ByteRange(cur_start, cur_end), tuple(members)))
    return spans


def group_spans(spans: Sequence[Span], *, max_ranges: int, max_bytes: int) -> list[list[Span]]:
    """Split spans into request groups of <= max_ranges spans and <= max_bytes in total
    (a group of one span may exceed max_bytes)."""
    groups: list[list[Span]] = []
    cur: list[Span] = []
    size = 0
    for span in spans:
        if cur and (len(cur) >= max_ranges or size + span.range.length > max_bytes):
            groups.append(cur)
            cur, size = [], 0
        cur.append(span)
        size += span.range.length
    if cur:
        groups.append(cur)
    return groups


def range_header(ranges: Sequence[ByteRange]) -> str:
    return "bytes=" + ",".join(r.header_spec() for r in ranges)


_CONTENT_RANGE_RE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def parse_content_range(value: str) -> tuple[ByteRange, int | None]:
    """`bytes a-b/total` -> (ByteRange(a, b+1), total or None for `*`)."""
    m = _CONTENT_RANGE_RE.match(value)
    if not m:
        raise RangeError(f"malformed Content-Range {value!r}")
    start, last = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    if last < start or (total is not None and last >= total):
        raise RangeError(f"inconsistent Content-Range {value!r}")
    return ByteRange(start, last + 1), total


_BOUNDARY_RE = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)


def multipart_boundary(content_type: str) -> str | None:
    """The boundary of a `multipart/byteranges` Content-Type, or None if it is not one."""
    if not content_type.lower().lstrip().startswith("multipart/byteranges"):
        return None
    m = _BOUNDARY_RE.search(content_type)
    if not m:
        raise RangeError(f"multipart/byteranges without a boundary: {content_type!r}")
    return m.group(1) or m.group(2)


def parse_multipart_byteranges(body: bytes, boundary: str) -> list[tuple[ByteRange, bytes]]:
    """Split a multipart/byteranges body (RFC 9110 §14.6) into (range, bytes) parts.

    Each part's length must equal its Content-Range; a part without one is an error.
    """
    delim = b"--" + boundary.encode("latin-1")
    parts: list[tuple[ByteRange, bytes]] = []
    pos = body.find(delim)
    if pos < 0:
        raise RangeError("multipart body has no boundary line")
    while True:
        pos += len(delim)
        if body.startswith(b"--", pos):
            return parts
        line_end = body.find(b"\r\n", pos)
        if line_end < 0:
            raise RangeError("truncated multipart body (no part header)")
        head_end = body.find(b"\r\n\r\n", line_end)
        if head_end < 0:
            # A part with no headers has its blank line right after the boundary line.
            raise RangeError("truncated multipart body (no header end)")
        content_range: ByteRange | None = None
        for raw in body[line_end + 2:head_end].split(b"\r\n"):
            name, _, value = raw.decode("latin-1").partition(":")
            if name.strip().lower() == "content-range":
                content_range, _ = parse_content_range(value)
        if content_range is None:
            raise RangeError("multipart part without Content-Range")
        data_start = head_end + 4
        data_end = data_start + content_range.length
        if data_end > len(body):
            raise RangeError(f"multipart part {content_range} is truncated")
        parts.append((content_range, body[data_start:data_end]))
        nxt = body.find(delim, data_end)
        if nxt < 0:
            raise RangeError("multipart body not terminated")
        pos = nxt
